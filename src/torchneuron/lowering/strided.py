"""A strided view of a flat buffer, written as reshapes, slices, a permute and
an expand wherever the layout allows.

Lowered graphs see their inputs as flat buffers and take each argument's view
of one. `as_strided` decomposes (in torch.export) into a gather with constant
int64 index tensors as large as the view: a transposed 256x256 weight became
three 512 KiB literals, so a fused backward graph was 11 MB of MLIR, slow to
compile and a gather to run. Transposes, slices (a q/k/v split, a column
block) and broadcasts are plain layout changes the compiler handles well;
the rest (overlapping views) gathers at positions computed from aranges.
"""

from __future__ import annotations

import math

import torch


def layout_of(shape, stride, offset: int, length: int):
    """How to take the view (shape, stride, offset) of a flat buffer of
    `length` elements without as_strided: (origin, base, starts, inner,
    order), or None when it overlaps itself or wraps around (strided_view
    then gathers at computed positions).

    base: the buffer's elements from `origin` reshaped, one dimension per
    dimension of the view that moves (outermost first), plus a last one of
    the innermost stride when that is not 1; starts: where the view begins in
    each; order: the view's dimensions in base order. The origin is the
    buffer's start (a q/k/v split: a slice of each row) or else the view's
    own offset (a block that begins inside a row)."""
    moving = [d for d in range(len(shape)) if shape[d] != 1 and stride[d] != 0]
    if math.prod(shape) == 0 or any(stride[d] < 0 for d in moving):
        return None
    order = tuple(sorted(moving, key=lambda d: -stride[d]))
    if not order:
        return (offset, (1,), (0,), 1, ()) if offset < length else None
    for origin in (0, offset):
        found = _from(origin, shape, stride, offset - origin, length - origin, order)
        if found is not None:
            return (origin, *found, order)
    return None


def _from(origin, shape, stride, rest, length, order):
    base, starts = [length // stride[order[0]]], []
    for j, d in enumerate(order):
        if j:
            if stride[order[j - 1]] % stride[d]:
                return None
            base.append(stride[order[j - 1]] // stride[d])
        starts.append(rest // stride[d])
        rest %= stride[d]
        if starts[j] + shape[d] > base[j]:
            return None  # overlapping or wrapping into the next row
    inner = stride[order[-1]]
    if inner != 1:
        base.append(inner)
        starts.append(rest)
    elif rest:
        return None
    return tuple(base), tuple(starts), inner


def strided_view(flat: torch.Tensor, shape, stride, offset: int) -> torch.Tensor:
    """flat.as_strided(shape, stride, offset) for a 1-D `flat`, as layout ops
    where possible (see layout_of), else as a gather (a copy)."""
    shape, stride = tuple(shape), tuple(stride)
    layout = layout_of(shape, stride, offset, flat.shape[0])
    if layout is None:
        return flat[strided_index(shape, stride, offset, flat.device)]
    origin, base, starts, inner, order = layout
    v = flat.narrow(0, origin, math.prod(base)).view(base)
    for j, d in enumerate(order):
        if starts[j] or shape[d] != base[j]:
            v = v.narrow(j, starts[j], shape[d])
    if inner != 1:
        v = v.select(len(order), starts[-1])
    # Back to the view's own order of dimensions, then its size-1 and broadcast ones.
    if order:
        v = v.permute([order.index(d) for d in sorted(order)])
    kept = [shape[d] if d in order else 1 for d in range(len(shape))]
    v = v.reshape(kept)
    return v.expand(shape) if tuple(kept) != shape else v


def strided_index(shape, stride, offset: int, device=None) -> torch.Tensor:
    """The flat position of each element of the view, computed from aranges
    (no constant as large as the view): for writes through a view, which
    index_put updates in place, and for views no layout takes."""
    index = torch.full((1,) * len(shape), offset, dtype=torch.int64, device=device)
    for d, (n, st) in enumerate(zip(shape, stride)):
        if n != 1 and st != 0:
            along = [1] * len(shape)
            along[d] = n
            index = index + (torch.arange(n, dtype=torch.int64, device=device) * st).view(along)
    return index.expand(tuple(shape))


__all__ = ["layout_of", "strided_index", "strided_view"]
