"""Bounds checks compiled into ops that index: a device reads or writes out of
range silently, so these ops also compute a flag (any index out of range) and
clamp their indices. The runtime raises for a set flag at the next sync point,
naming the op and its source line, as CUDA's device-side asserts do."""

from __future__ import annotations

import torch

aten = torch.ops.aten

# op -> (index argument, how to get the bound from the arguments, negative
# indices allowed (they are wrapped: torch-mlir's scatters do not wrap them),
# a target value that is skipped (nll_loss's ignore_index argument) or None)
_DIM_OF_SELF = lambda a: a["self"].shape[a["dim"]] if a["self"].dim() else 1  # noqa: E731
_NUMEL = lambda a: a["self"].numel()  # noqa: E731
_CLASSES = lambda a: a["self"].shape[1] if a["self"].dim() >= 2 else a["self"].shape[0]  # noqa: E731
_BY_DIM = ("index", _DIM_OF_SELF, False, None)
_BY_POSITION = ("indices", None, True, None)
_TARGET = ("target", _CLASSES, False, "ignore_index")
INDEX_CHECKS = {
    aten.embedding.default: ("indices", lambda a: a["weight"].shape[0], False, None),
    aten.embedding_dense_backward.default: ("indices", lambda a: a["num_weights"], False, "padding_idx"),
    aten.index_select.default: _BY_DIM,
    aten.gather.default: _BY_DIM,
    aten.scatter.src: _BY_DIM,
    aten.scatter.value: _BY_DIM,
    aten.scatter.reduce: _BY_DIM,
    aten.scatter.value_reduce: _BY_DIM,
    aten.scatter_.src: _BY_DIM,
    aten.scatter_.value: _BY_DIM,
    aten.scatter_.reduce: _BY_DIM,
    aten.scatter_.value_reduce: _BY_DIM,
    aten.scatter_add.default: _BY_DIM,
    aten.scatter_add_.default: _BY_DIM,
    aten.scatter_reduce.two: _BY_DIM,
    aten.scatter_reduce_.two: _BY_DIM,
    aten.index_add.default: _BY_DIM,
    aten.index_add_.default: _BY_DIM,
    aten.index_copy.default: _BY_DIM,
    aten.index_copy_.default: _BY_DIM,
    aten.index_fill.int_Scalar: _BY_DIM,
    aten.index_fill.int_Tensor: _BY_DIM,
    aten.index_fill_.int_Scalar: _BY_DIM,
    aten.index_fill_.int_Tensor: _BY_DIM,
    aten.index_reduce.default: _BY_DIM,
    aten.index_reduce_.default: _BY_DIM,
    aten.take.default: ("index", _NUMEL, True, None),
    aten.put.default: ("index", _NUMEL, True, None),
    aten.put_.default: ("index", _NUMEL, True, None),
    aten.index.Tensor: _BY_POSITION,
    aten.index_put.default: _BY_POSITION,
    aten.index_put_.default: _BY_POSITION,
    aten._index_put_impl_.default: _BY_POSITION,
    aten.nll_loss_forward.default: _TARGET,
    aten.nll_loss_backward.default: _TARGET,
    aten.nll_loss2d_forward.default: _TARGET,
    aten.nll_loss2d_backward.default: _TARGET,
}


def has_checks(op) -> bool:
    return op in INDEX_CHECKS


def apply(op, args: tuple, kwargs: dict):
    """(args, kwargs with indices clamped into range and negative ones wrapped,
    flag tensor: True if any index was out of range)."""
    name, bound, negative, skipped = INDEX_CHECKS[op]
    names = [a.name for a in op._schema.arguments]
    values = dict(zip(names, args))
    values.update(kwargs)
    bad = torch.zeros((), dtype=torch.bool)
    skip = values.get(skipped) if skipped else None

    def check(index, n):
        nonlocal bad
        if index is None or index.dtype == torch.bool:
            return index
        low = -n if negative else 0
        out_of_range = (index < low) | (index >= n)
        if skip is not None:
            out_of_range = out_of_range & (index != skip)
        bad = bad | out_of_range.any()
        if n == 0:
            return index
        fixed = index.clamp(low, n - 1)
        if negative:
            fixed = torch.where(fixed < 0, fixed + n, fixed)
        if skip is not None:
            fixed = torch.where(index == skip, index, fixed)
        return fixed

    index = values[name]
    if bound is None:  # a list of indices, one per leading dimension of self
        shape = values["self"].shape
        # torch-mlir lowers index.Tensor and index_put with int64 positions
        # only (int32 ones failed in iree-compile: 'arith.cmpi' operand types).
        index = [ix.long() if ix is not None and ix.dtype in (torch.int32, torch.int16) else ix for ix in index]
        index = [check(ix, shape[i]) if i < len(shape) else ix for i, ix in enumerate(index)]
    else:
        index = check(index, bound(values))
    if name in kwargs:
        kwargs = dict(kwargs, **{name: index})
    else:
        pos = names.index(name)
        args = args[:pos] + (index,) + args[pos + 1:]
    return args, kwargs, bad
