"""Bounds checks compiled into ops that index: a device reads or writes out of
range silently, so these ops also compute a flag (any index out of range) and
clamp their indices. The runtime raises for a set flag at the next sync point,
naming the op and its source line, as CUDA's device-side asserts do."""

from __future__ import annotations

import torch

aten = torch.ops.aten

# op -> (index argument, how to get the bound from the arguments, negative indices allowed)
_DIM_OF_SELF = lambda a: a["self"].shape[a["dim"]] if a["self"].dim() else 1  # noqa: E731
INDEX_CHECKS = {
    aten.embedding.default: ("indices", lambda a: a["weight"].shape[0], False),
    aten.index_select.default: ("index", _DIM_OF_SELF, False),
    aten.gather.default: ("index", _DIM_OF_SELF, False),
    aten.scatter.src: ("index", _DIM_OF_SELF, False),
    aten.scatter.value: ("index", _DIM_OF_SELF, False),
    aten.scatter_.src: ("index", _DIM_OF_SELF, False),
    aten.scatter_.value: ("index", _DIM_OF_SELF, False),
    aten.scatter_add.default: ("index", _DIM_OF_SELF, False),
    aten.scatter_add_.default: ("index", _DIM_OF_SELF, False),
    aten.index_add.default: ("index", _DIM_OF_SELF, False),
    aten.index_copy.default: ("index", _DIM_OF_SELF, False),
    aten.take.default: ("index", lambda a: a["self"].numel(), True),
    aten.index.Tensor: ("indices", None, True),
    aten.index_put.default: ("indices", None, True),
    aten.index_put_.default: ("indices", None, True),
}


def has_checks(op) -> bool:
    return op in INDEX_CHECKS


def apply(op, args: tuple, kwargs: dict):
    """(args, kwargs with clamped indices, flag tensor: True if any index was out of range)."""
    name, bound, negative = INDEX_CHECKS[op]
    names = [a.name for a in op._schema.arguments]
    values = dict(zip(names, args))
    values.update(kwargs)
    bad = torch.zeros((), dtype=torch.bool)

    def check(index, n):
        nonlocal bad
        if index is None or index.dtype == torch.bool or n == 0:
            return index
        low = -n if negative else 0
        bad = bad | ((index < low) | (index >= n)).any()
        return index.clamp(low, n - 1)

    index = values[name]
    if bound is None:  # a list of indices, one per leading dimension of self
        shape = values["self"].shape
        index = [check(ix, shape[i]) if i < len(shape) else ix for i, ix in enumerate(index)]
    else:
        index = check(index, bound(values))
    if name in kwargs:
        kwargs = dict(kwargs, **{name: index})
    else:
        pos = names.index(name)
        args = args[:pos] + (index,) + args[pos + 1:]
    return args, kwargs, bad
