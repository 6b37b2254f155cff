"""Long matrix products in blocks of their inner dimension (split-K).

IREE's llvm-cpu matmul accumulates each result element over the whole inner
dimension K in order, so its float32 rounding error grows with K: a
[16, 8192] @ [8192, 32] product was 5.9e-4 off float64, CPU 1.1e-4, and the
census's registry held 13 such products (K 3145-12288) 5-9x further off than
CPU. Here a product with K > LONG_K is computed as a batch of products over
blocks of the inner dimension, then the blocks' results are summed: the error
grows with the block plus the number of blocks (blocks of 256: as close as
CPU's). The blocks' partial results take S x M x N floats: blocks grow past
256 where they would pass PARTIALS elements, and a product is left whole where
that leaves fewer than FEWEST blocks (a [1024, 4096] @ [4096, 1024] product in
8 blocks took 15% longer). Float32 and float64 only.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten

LONG_K = 1024
BLOCK_K = 256
PARTIALS = 1 << 21  # elements (8 MiB of float32)
FEWEST = 4  # fewer blocks gain too little accuracy for their partial results' traffic


def _blocks(k: int, rows: int) -> int:
    """Number of whole blocks to split an inner dimension of k into, `rows`
    the elements of one block's result (M x N, times the batch)."""
    count = k // BLOCK_K
    return max(1, min(count, PARTIALS // max(1, rows)))


def _static(*tensors) -> bool:
    return all(isinstance(n, int) for t in tensors for n in t.shape)


def _splits(a, b) -> bool:
    return (a.dtype in (torch.float32, torch.float64) and b.dtype == a.dtype and _static(a, b)
            and a.shape[-1] > LONG_K)


def mm(a, b):
    if not _splits(a, b):
        return NotImplemented
    (m, k), n = a.shape, b.shape[1]
    count = _blocks(k, m * n)
    if count < FEWEST:
        return NotImplemented
    size = -(-k // count)
    a, b = _padded(a, 1, size * count), _padded(b, 0, size * count)
    left = aten.permute.default(aten.reshape.default(a, [m, count, size]), [1, 0, 2])
    right = aten.reshape.default(b, [count, size, n])
    return aten.sum.dim_IntList(aten.bmm.default(left, right), [0], False)


def _padded(x, dim: int, length: int):
    """x with zeros after its end along dim, to `length` (zeros add nothing
    to a product; one block's tail product would be a dispatch of its own)."""
    extra = length - x.shape[dim]
    if extra == 0:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim) + [0, extra]
    return aten.constant_pad_nd.default(x, pad, 0.0)


def bmm(a, b):
    if not _splits(a, b):
        return NotImplemented
    (batch, m, k), n = a.shape, b.shape[2]
    count = _blocks(k, batch * m * n)
    if count < FEWEST:
        return NotImplemented
    size = -(-k // count)
    a, b = _padded(a, 2, size * count), _padded(b, 1, size * count)
    left = aten.reshape.default(
        aten.permute.default(aten.reshape.default(a, [batch, m, count, size]), [0, 2, 1, 3]),
        [batch * count, m, size])
    right = aten.reshape.default(b, [batch * count, size, n])
    partial = aten.reshape.default(aten.bmm.default(left, right), [batch, count, m, n])
    return aten.sum.dim_IntList(partial, [1], False)


def rules() -> dict:
    return {aten.mm.default: mm, aten.bmm.default: bmm}

