"""Long scans in blocks on GPU targets.

IREE 3.13's SPIR-V code for a scan (cumsum, cumprod: linalg_ext.scan) gave
wrong values on lavapipe once the scanned dimension passed about 16k
elements, in every dtype (a float32 cumsum of 65536 elements had only its
first element right, of 32768 its last few wrong; 16384 was exact). Here a
scan longer than BLOCK is a scan within blocks of BLOCK elements, a scan of
the blocks' totals (in blocks again where there are more than BLOCK of
them), and each block's prefix combined with the blocks before it: the same
result, summed in a different order, with every scan short. (PyTorch's CUDA
kernels scan in blocks too.) The CPU target keeps its one long scan.
"""

from __future__ import annotations

import torch

from ..target import gpu_target

aten = torch.ops.aten

# Well below the length where the scans went wrong.
BLOCK = 4096

# op: (the identity its padding and first offset hold, how a prefix is combined with an offset)
_SCANS = {
    aten.cumsum.default: (0, aten.add.Tensor),
    aten.cumprod.default: (1, aten.mul.Tensor),
}


def in_blocks(op):
    identity, combine = _SCANS[op]

    def decompose(x, dim, *, dtype=None):
        if not gpu_target() or x.dim() == 0 or x.shape[dim] <= BLOCK:
            return NotImplemented
        if dtype is not None:
            x = aten._to_copy.default(x, dtype=dtype)
        dim = dim % x.dim()
        n = x.shape[dim]
        blocks = -(-n // BLOCK)
        moved = aten.movedim.int(x, dim, -1)
        if blocks * BLOCK != n:
            moved = aten.constant_pad_nd.default(moved, [0, blocks * BLOCK - n], identity)
        rows = list(moved.shape[:-1])
        within = op(aten.reshape.default(moved, rows + [blocks, BLOCK]), -1)
        totals = aten.select.int(within, -1, BLOCK - 1)  # [..., blocks]
        through = op(totals, -1)  # inclusive: long again where blocks > BLOCK
        first = aten.full.default(rows + [1], identity, dtype=through.dtype, device=through.device)
        before = aten.cat.default([first, aten.slice.Tensor(through, -1, 0, blocks - 1)], -1)
        scanned = combine(within, aten.unsqueeze.default(before, -1))
        flat = aten.reshape.default(scanned, rows + [blocks * BLOCK])
        out = aten.slice.Tensor(flat, -1, 0, n)
        return aten.clone.default(aten.movedim.int(out, -1, dim), memory_format=torch.contiguous_format)

    return decompose


def decompositions() -> dict:
    return {op: in_blocks(op) for op in _SCANS}
