"""Running extremes and order statistics as CPU computes them.

IREE lowers no cummax/cummin (torch-mlir's scan of a value and its index
did not compile), kthvalue or median; they ran on the host. Here:

- cummax / cummin as a doubling scan (log2(n) steps of elementwise selects
  between each element's window and the window before it): the running
  extreme with CPU's index rules, the latest of equal values and NaN above
  everything (once a NaN is met, the values stay NaN and the index moves to
  each later NaN, as CPU's kernel).
- kthvalue and median from a stable sort of the row (NaN last, equal values
  in their order), so ties give CPU's index (the first of the equal values in
  the row); median's row with a NaN gives NaN and the first NaN's index.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


def _running_extreme(larger: bool):
    def decompose(x, dim):
        if x.dim() == 0 or x.numel() == 0 or x.dtype.is_complex:
            return NotImplemented
        dim = dim % x.dim()
        values = x.movedim(dim, -1)
        narrow = values.dtype if values.dtype in (torch.uint8, torch.bool) else None  # (uint8 compared signed)
        if narrow is not None:
            values = values.to(torch.int32)
        n = values.shape[-1]
        rows = list(values.shape[:-1])
        indices = torch.arange(n, device=x.device).expand(rows + [n])
        floating = values.dtype.is_floating_point
        shift = 1
        while shift < n:
            earlier = torch.cat([values[..., :shift], values[..., : n - shift]], -1)
            earlier_index = torch.cat([indices[..., :shift], indices[..., : n - shift]], -1)
            beyond = earlier > values if larger else earlier < values
            if floating:
                beyond = (beyond | torch.isnan(earlier)) & ~torch.isnan(values)
            has_earlier = (torch.arange(n, device=x.device) >= shift).expand(rows + [n])
            take = beyond & has_earlier
            values = torch.where(take, earlier, values)
            indices = torch.where(take, earlier_index, indices)
            shift *= 2
        if narrow is not None:
            values = values.to(narrow)
        return (values.movedim(-1, dim).contiguous(), indices.movedim(-1, dim).contiguous())

    return decompose


# A stable sort keeps rows of up to this many elements (nan_propagation's limit).
_STABLE_ROW = 4096


def _sorted_rows(x, dim):
    stable = x.shape[dim] <= _STABLE_ROW
    return torch.sort(x, dim=dim, stable=True) if stable else torch.sort(x, dim=dim)


def _pick(x, dim, keepdim, position):
    """The sorted row's element at `position` (a tensor of the row's shape
    with dim kept, or an int) and its index in the row."""
    values, indices = _sorted_rows(x, dim)
    if isinstance(position, int):
        value, index = values.narrow(dim, position, 1), indices.narrow(dim, position, 1)
    else:
        value, index = torch.gather(values, dim, position), torch.gather(indices, dim, position)
    if not keepdim:
        value, index = value.squeeze(dim), index.squeeze(dim)
    return value, index


def kthvalue(x, k, dim=-1, keepdim=False):
    if x.dim() == 0 or x.dtype.is_complex or not 1 <= k <= x.shape[dim]:
        return NotImplemented  # (CPU's own errors on the host path)
    return _pick(x, dim % x.dim(), keepdim, k - 1)


def median_dim(x, dim, keepdim=False):
    if x.dim() == 0 or x.numel() == 0 or x.dtype.is_complex:
        return NotImplemented
    dim = dim % x.dim()
    n = x.shape[dim]
    lower = (n - 1) // 2
    if not x.dtype.is_floating_point:
        return _pick(x, dim, keepdim, lower)
    nans = torch.isnan(x).sum(dim, keepdim=True)
    # A row with NaN: the first NaN, which a stable sort puts at n - nans.
    position = torch.where(nans > 0, n - nans, torch.full_like(nans, lower))
    return _pick(x, dim, keepdim, position)


def median(x):
    if x.numel() == 0 or x.dtype.is_complex:
        return NotImplemented
    return median_dim(x.reshape(-1), 0)[0]


def decompositions() -> dict:
    return {
        aten.cummax.default: _running_extreme(larger=True),
        aten.cummin.default: _running_extreme(larger=False),
        aten.kthvalue.default: kthvalue,
        aten.median.dim: median_dim,
        aten.median.default: median,
    }
