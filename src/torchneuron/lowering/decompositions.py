"""The decomposition table applied before import: PyTorch's core ATen set,
plus the multi-tensor (_foreach_) ops, which torch-mlir does not know: they
are traced through PyTorch's own per-tensor kernels into one graph."""

from __future__ import annotations

import functools

import torch
from torch._decomp import core_aten_decompositions

_PER_TENSOR = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


def _foreach_decomposition(op):
    def decompose(*args, **kwargs):
        # The CPU slot of a _foreach_ op holds its per-tensor composite kernel.
        return op.redispatch(_PER_TENSOR, *args, **kwargs)

    return decompose


def _squeeze_dims(x, dims):
    # torch-mlir has no squeeze.dims; shapes are static, so it is a reshape.
    dims = {d % x.dim() for d in dims} if x.dim() else set()
    shape = [n for i, n in enumerate(x.shape) if not (i in dims and n == 1)]
    return torch.ops.aten.reshape.default(x, shape)


@functools.lru_cache(maxsize=None)
def decomposition_table() -> dict:
    table = dict(core_aten_decompositions())
    table[torch.ops.aten.squeeze.dims] = _squeeze_dims
    for name in dir(torch.ops.aten):
        if not name.startswith("_foreach_") or name.endswith("_"):
            continue
        packet = getattr(torch.ops.aten, name)
        for overload in packet.overloads():
            op = getattr(packet, overload)
            if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeExplicitAutograd"):
                table[op] = _foreach_decomposition(op)
    return table
