"""NaN in, NaN out, as CPU's kernels.

IREE's CPU code lets a NaN lose against a number in clamp and in binary
max/min (clamp(nan, -1, 1) gave -1, relu6(nan) 0, maximum(nan, 1) 1), and
argmax, argmin and the indices of max/min over a dimension skipped NaNs
(CPU takes a NaN as the extreme, its first one); sort and topk put NaNs
anywhere (CPU orders them above +inf). A NaN there hides the very failure a
user looks for. Here each is written with comparisons and selects, which
keep NaNs (a comparison with NaN is false), and an explicit test where a
NaN must win; sort and topk order integer keys of the floats' bits.
Elementwise ones see float16 and bfloat16 through float32; integers keep the
lowering's own (no NaN to keep).
"""

from __future__ import annotations

import math

import torch

aten = torch.ops.aten


def _floating(x) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype.is_floating_point


def _nan_bound(bound) -> bool:
    return isinstance(bound, float) and math.isnan(bound)


def _clamp(x, low, high):
    if not _floating(x) or _nan_bound(low) or _nan_bound(high):
        return NotImplemented  # (a NaN number as a bound: left to the lowering's own, which drops it)
    r = x
    if low is not None:
        r = torch.where(r < low, low, r)
    if high is not None:
        r = torch.where(r > high, high, r)  # (low > high gives high, as CPU's)
    for bound in (low, high):
        if isinstance(bound, torch.Tensor) and bound.dtype.is_floating_point:
            r = torch.where(torch.isnan(bound), bound, r)
    return r


def clamp(x, min=None, max=None):  # noqa: A002 - aten's argument names
    return _clamp(x, min, max)


def clamp_min(x, min):  # noqa: A002
    return _clamp(x, min, None)


def clamp_max(x, max):  # noqa: A002
    return _clamp(x, None, max)


def hardtanh(x, min_val=-1.0, max_val=1.0):
    return _clamp(x, min_val, max_val)


def hardsigmoid(x):
    if not _floating(x):
        return NotImplemented
    return _clamp(x + 3.0, 0.0, 6.0) / 6.0


def maximum(a, b):
    if not (_floating(a) and _floating(b)):
        return NotImplemented
    return torch.where(torch.isnan(b), b, torch.where(a < b, b, a))


def minimum(a, b):
    if not (_floating(a) and _floating(b)):
        return NotImplemented
    return torch.where(torch.isnan(b), b, torch.where(a > b, b, a))


def _first_extreme(x, dim, keepdim, largest):
    """Index of the first largest (smallest) element along dim, a NaN first."""
    dim = dim % max(x.dim(), 1)
    n = x.shape[dim] if x.dim() else 1
    shape = [1] * x.dim()
    if x.dim():
        shape[dim] = n
    positions = torch.arange(n, device=x.device).reshape(shape)
    nan = torch.isnan(x)
    clean = torch.where(nan, -math.inf if largest else math.inf, x)
    extreme = torch.amax(clean, dim, keepdim=True) if largest else torch.amin(clean, dim, keepdim=True)
    first = torch.where(clean == extreme, positions, n).amin(dim, keepdim=keepdim)
    first_nan = torch.where(nan, positions, n).amin(dim, keepdim=keepdim)
    return torch.where(first_nan < n, first_nan, first)


def _arg_extreme(x, dim, keepdim, largest):
    if not _floating(x):
        return NotImplemented
    if dim is None:  # over all elements; keepdim keeps every dimension as 1
        index = _first_extreme(x.reshape(-1), 0, False, largest)
        return index.reshape([1] * x.dim()) if keepdim else index
    return _first_extreme(x, dim, keepdim, largest)


def argmax(x, dim=None, keepdim=False):
    return _arg_extreme(x, dim, keepdim, largest=True)


def argmin(x, dim=None, keepdim=False):
    return _arg_extreme(x, dim, keepdim, largest=False)


def max_dim(x, dim, keepdim=False):
    if not _floating(x) or x.dim() == 0:
        return NotImplemented
    return torch.amax(x, dim, keepdim=keepdim), _first_extreme(x, dim, keepdim, largest=True)


def min_dim(x, dim, keepdim=False):
    if not _floating(x) or x.dim() == 0:
        return NotImplemented
    return torch.amin(x, dim, keepdim=keepdim), _first_extreme(x, dim, keepdim, largest=False)


_SORTABLE = (torch.float32, torch.float16, torch.bfloat16)


def _order_key(x):
    """int32 keys ordered as CPU orders x: NaNs (of either sign) above +inf,
    -0.0 equal to 0.0 (float16 and bfloat16 exactly through float32)."""
    x = x.to(torch.float32)
    x = torch.where(torch.isnan(x), math.nan, torch.where(x == 0, 0.0, x))
    bits = x.view(torch.int32)
    # Negative floats: a larger magnitude is a larger int, so they turn around
    # as (-1 - bits) + INT_MIN, in range at each step (torch-mlir lowers no
    # bitwise_xor by a number).
    turned = (torch.full_like(bits, -1) - bits) + torch.full_like(bits, -2**31)
    return torch.where(bits < 0, turned, bits)


def _sortable(x) -> bool:
    # (a 0-d bitcast crashes IREE's compiler; a 0-d sort has nothing to order)
    return isinstance(x, torch.Tensor) and x.dtype in _SORTABLE and x.dim() > 0


# IREE sorts a row in one workgroup with the row on its stack, at most 32 KiB:
# int64 keys for rows of up to 4096 elements.
_STABLE_ROW_LIMIT = 4096


def _sorted_indices(x, dim, descending, stable):
    """Indices that sort x along dim in CPU's order; None where this cannot
    sort it. A stable sort orders int64 keys that hold the position too (IREE's
    sort is not stable, torch-mlir lowers no sort.stable); any other sorts the
    int32 keys."""
    dim = dim % x.dim()
    if not stable:
        return torch.sort(_order_key(x), dim=dim, descending=descending).indices
    return _stable_order(_order_key(x), dim, descending)


def _stable_order(key, dim, descending):
    """Indices of a stable sort of integer keys of at most 32 bits along dim:
    the int64 key * n + position has no ties left, so IREE's sort gives CPU's
    order of equal keys (their positions) too."""
    n = key.shape[dim]
    if n > _STABLE_ROW_LIMIT:
        return None
    shape = [1] * key.dim()
    shape[dim] = n
    positions = torch.arange(n, device=key.device).reshape(shape)
    if descending:  # the first of equal elements has the larger combined key
        positions = torch.full_like(positions, n - 1) - positions
    combined = key.to(torch.int64) * n + positions
    return torch.sort(combined, dim=dim, descending=descending).indices


# Elements compared pairwise to rank int64 keys, at most (n^2 per row).
_PAIRWISE_LIMIT = 1 << 22


def _int64_rank(x, dim):
    """For each element, how many along dim are smaller: a key of at most 32
    bits that orders x as x does (int64 values themselves leave no room for
    the position beside them)."""
    rows = x.movedim(dim, -1)
    smaller = (rows.unsqueeze(-2) < rows.unsqueeze(-1)).sum(-1)
    return smaller.movedim(-1, dim)


def _integer_sort(x, dim, descending, stable):
    """A stable sort of integers or bools in CPU's order, or NotImplemented
    (rows too long to sort in one workgroup, or to rank pairwise)."""
    if x.dim() == 0:
        return NotImplemented
    dim = dim % x.dim()
    if x.dtype == torch.int64:
        if x.numel() * x.shape[dim] > _PAIRWISE_LIMIT:
            return NotImplemented
        key = _int64_rank(x, dim)
    else:
        key = x
    indices = _stable_order(key, dim, descending)
    if indices is None:
        return NotImplemented
    return torch.gather(x, dim, indices), indices


_INTEGERS = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _sort(x, dim, descending, stable):
    if isinstance(x, torch.Tensor) and x.dtype in _INTEGERS:
        return _integer_sort(x, dim, descending, stable) if stable else NotImplemented
    if not _sortable(x):
        return NotImplemented
    indices = _sorted_indices(x, dim, descending, stable)
    if indices is None:
        return NotImplemented
    return torch.gather(x, dim, indices), indices


def sort(x, dim=-1, descending=False):
    return _sort(x, dim, descending, stable=False)


def sort_stable(x, *, stable=None, dim=-1, descending=False):
    return _sort(x, dim, descending, bool(stable))


def topk(x, k, dim=-1, largest=True, sorted=True):  # noqa: A002
    if not _sortable(x):
        return NotImplemented
    indices = torch.topk(_order_key(x), k, dim=dim, largest=largest, sorted=sorted).indices
    return torch.gather(x, dim, indices), indices


def decompositions() -> dict:
    return {
        aten.clamp.default: clamp, aten.clamp.Tensor: clamp,
        aten.clamp_min.default: clamp_min, aten.clamp_min.Tensor: clamp_min,
        aten.clamp_max.default: clamp_max, aten.clamp_max.Tensor: clamp_max,
        aten.hardtanh.default: hardtanh, aten.hardsigmoid.default: hardsigmoid,
        aten.maximum.default: maximum, aten.minimum.default: minimum,
        aten.argmax.default: argmax, aten.argmin.default: argmin,
        aten.max.dim: max_dim, aten.min.dim: min_dim,
        aten.sort.default: sort, aten.sort.stable: sort_stable, aten.topk.default: topk,
    }
