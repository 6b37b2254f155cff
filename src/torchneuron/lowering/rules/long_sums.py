"""Long sums in blocks, as PyTorch's CPU kernels sum (a cascade).

IREE's llvm-cpu codegen accumulates a reduction in order, one running sum per
vector lane, so a float32 sum's rounding error grows with its length: rows of
65536 normal values summed 3.1e-3 off, CPU 5.4e-5; a 1M-element tensor 3.1e-3
against 5.6e-5. Here a reduced dimension longer than LONG is summed as blocks
of BLOCK (a reshape of the dimension: no copy), then the blocks' sums, in
blocks again while they are long; adjacent dimensions summed together are
one dimension, others are reduced one at a time. The error then grows with
BLOCK plus the number of blocks, not with the length.
"""

from __future__ import annotations

import math

import torch

aten = torch.ops.aten

LONG = 128
BLOCK = 64
_FLOATING = (torch.float32, torch.float64)


def _dims(x, dim) -> list:
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return list(range(x.dim()))
    dims = [dim] if isinstance(dim, int) else list(dim)
    return sorted({d % x.dim() for d in dims}) if x.dim() else []


def _is_long(x, dims) -> bool:
    sizes = [x.shape[d] for d in dims]
    return all(isinstance(n, int) for n in sizes) and math.prod(sizes) > LONG


def _sum_dim(x, d: int):
    """x summed over dimension d, kept as a dimension of 1."""
    n = x.shape[d]
    if n <= LONG:
        return aten.sum.dim_IntList(x, [d], True)
    whole = n - n % BLOCK
    head = x if whole == n else aten.slice.Tensor(x, d, 0, whole)
    shape = list(x.shape)
    blocks = aten.reshape.default(head, shape[:d] + [whole // BLOCK, BLOCK] + shape[d + 1:])
    total = _sum_dim(aten.sum.dim_IntList(blocks, [d + 1], False), d)
    if whole < n:
        total = aten.add.Tensor(total, aten.sum.dim_IntList(aten.slice.Tensor(x, d, whole, n), [d], True))
    return total


def cascade_sum(x, dims, keepdim: bool):
    """sum(x, dims, keepdim) of a floating tensor, long dimensions in blocks."""
    kept = [n for i, n in enumerate(x.shape) if i not in dims]
    if dims == list(range(dims[0], dims[-1] + 1)):
        # Adjacent dimensions are one dimension summed in blocks, as CPU does.
        merged = aten.reshape.default(x, list(x.shape[:dims[0]]) + [-1] + list(x.shape[dims[-1] + 1:]))
        total = _sum_dim(merged, dims[0])
    else:
        total = x
        for d in dims:
            total = _sum_dim(total, d)
    if keepdim:
        return aten.reshape.default(total, [1 if i in dims else n for i, n in enumerate(x.shape)])
    return aten.reshape.default(total, kept)


def in_blocks(op, fallback=None):
    """Wrap a decomposition of sum, mean or linalg_vector_norm (or none:
    `fallback` None lowers the op whole) with blocked summation for long
    float32/float64 reductions of statically sized tensors."""
    name = op.name()

    def whole(*args, **kwargs):
        return NotImplemented if fallback is None else fallback(*args, **kwargs)

    if name == "aten::linalg_vector_norm":
        def decompose(x, ord=2, dim=None, keepdim=False, *, dtype=None):
            if dtype is not None:
                x = aten._to_copy.default(x, dtype=dtype)
            dims = _dims(x, dim)
            finite = isinstance(ord, (int, float)) and ord not in (0, math.inf, -math.inf) and ord > 0
            if x.dtype not in _FLOATING or not finite or not _is_long(x, dims):
                return whole(x, ord, dim, keepdim, dtype=None)
            powers = aten.mul.Tensor(x, x) if ord == 2 else aten.pow.Tensor_Scalar(aten.abs.default(x), ord)
            total = cascade_sum(powers, dims, keepdim)
            return aten.sqrt.default(total) if ord == 2 else aten.pow.Tensor_Scalar(total, 1.0 / ord)

        return decompose

    def decompose(x, *args, dtype=None, **kwargs):
        dim = args[0] if args else kwargs.get("dim")
        keepdim = args[1] if len(args) > 1 else kwargs.get("keepdim", False)
        target = dtype or x.dtype
        dims = _dims(x, dim)
        if target not in _FLOATING or not _is_long(x, dims):
            return whole(x, *args, dtype=dtype, **kwargs)
        if x.dtype != target:
            x = aten._to_copy.default(x, dtype=target)
        total = cascade_sum(x, dims, keepdim)
        if name.startswith("aten::mean"):
            total = aten.div.Tensor(total, math.prod(x.shape[d] for d in dims))
        return total

    return decompose
