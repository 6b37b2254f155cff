"""The decomposition table applied before import: PyTorch's core ATen set,
plus the multi-tensor (_foreach_) ops, which torch-mlir does not know: they
are traced through PyTorch's own per-tensor kernels into one graph."""

from __future__ import annotations

import functools
import math

import torch
from torch._decomp import core_aten_decompositions, decomposition_table as _all_decompositions

from . import amp, linalg, rnn_cells, special, tensor_ops

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


def _log10(x):
    # IREE's CPU runtime has no log10f.
    return torch.ops.aten.mul.Tensor(torch.ops.aten.log.default(x), 1.0 / math.log(10.0))


_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _accumulate_in_float32(op):
    """Sums and means of float16/bfloat16 accumulate in float32, as PyTorch's
    kernels do (IREE would accumulate in the input's type: a 1024-element
    float16 sum was 20x further off than CPU's)."""

    def decompose(x, *args, dtype=None, **kwargs):
        if dtype is not None or x.dtype not in _LOW_PRECISION:
            return NotImplemented
        return op(x, *args, dtype=torch.float32, **kwargs).to(x.dtype)

    return decompose


def _in_float32(op, existing):
    """A pointwise op on float16/bfloat16 computes in float32 and rounds its
    result once, as PyTorch's kernels do ("opmath"); IREE would compute every
    step in the narrow type (float16 training drifted 3% from CPU's float16
    within 16 steps of the demo GPT). Other calls go to `existing`."""
    from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

    def decompose(*args, **kwargs):
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if tensors and any(t.dtype in _LOW_PRECISION for t in tensors) and "dtype" not in kwargs:
            _, result = elementwise_dtypes(*tensors, type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT)
            if result in _LOW_PRECISION:
                def up(a):
                    return a.to(torch.float32) if isinstance(a, torch.Tensor) and a.dtype in _LOW_PRECISION else a

                out = op(*[up(a) for a in args], **{k: up(v) for k, v in kwargs.items()})
                if isinstance(out, torch.Tensor):
                    return out.to(result) if out.dtype == torch.float32 else out
                return type(out)(o.to(result) if o.dtype == torch.float32 else o for o in out)
        return existing(*args, **kwargs) if existing is not None else NotImplemented

    return decompose


def _pointwise_float_ops():
    """Functional pointwise aten ops (PyTorch's pointwise tag), not in-place or out=."""
    ops = []
    for name in dir(torch.ops.aten):
        if name.endswith("_") or name.startswith("_foreach"):
            continue
        packet = getattr(torch.ops.aten, name, None)
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            if torch.Tag.pointwise not in op.tags or "out" in overload:
                continue
            schema = op._schema
            if any(a.is_out for a in schema.arguments) or any(
                a.alias_info is not None and a.alias_info.is_write for a in schema.arguments
            ):
                continue
            ops.append(op)
    return ops


def _view_copy_decomposition(view_op):
    def decompose(*args, **kwargs):
        result = view_op(*args, **kwargs)
        if isinstance(result, (list, tuple)):
            return [r.clone() for r in result]
        return result.clone()

    return decompose


def _view_copies() -> dict:
    """X_copy ops (view_copy, permute_copy, ...): the view X, then a copy."""
    table = {}
    for name in dir(torch.ops.aten):
        if not name.endswith("_copy") or name.startswith("_"):
            continue
        base = getattr(torch.ops.aten, name[: -len("_copy")], None)
        if base is None:
            continue
        packet = getattr(torch.ops.aten, name)
        for overload in packet.overloads():
            if overload in base.overloads() and overload != "out":
                table[getattr(packet, overload)] = _view_copy_decomposition(getattr(base, overload))
    return table


@functools.lru_cache(maxsize=None)
def own_decompositions() -> dict:
    """torchneuron's decompositions. The lowering calls them in place of the op
    itself, before tracing: PyTorch traces some ops (upsampling) through its
    own Python kernels, which no table entry can replace."""
    table = dict(special.decompositions())
    table.update(tensor_ops.decompositions())
    table.update(linalg.decompositions())
    table.update(rnn_cells.decompositions())
    table.update(amp.decompositions())
    return table


@functools.lru_cache(maxsize=None)
def direct_decompositions() -> dict:
    """What the lowering calls in place of the op: the decompositions above,
    plus rewrites that end in the op itself (not for the export's table)."""
    table = dict(own_decompositions())
    table.update(tensor_ops.direct_rewrites())
    return table


@functools.lru_cache(maxsize=None)
def decomposition_table() -> dict:
    # Beyond the core set, PyTorch's other aten-to-aten decompositions:
    # torch-mlir lowers the smaller ops they produce where it lacks the big
    # one. (Its torch._refs entries produce prims, which torch-mlir does not take.)
    table = {
        op: fn
        for op, fn in _all_decompositions.items()
        if getattr(fn, "__module__", "") == "torch._decomp.decompositions"
    }
    table.update(core_aten_decompositions())
    table.update(_view_copies())
    table[torch.ops.aten.squeeze.dims] = _squeeze_dims
    table[torch.ops.aten.log10.default] = _log10
    for op in (torch.ops.aten.sum.default, torch.ops.aten.sum.dim_IntList, torch.ops.aten.mean.default,
               torch.ops.aten.mean.dim):
        table[op] = _accumulate_in_float32(op)
    table.update(own_decompositions())
    for op in _pointwise_float_ops():
        table[op] = _in_float32(op, table.get(op))
    for name in dir(torch.ops.aten):
        if not name.startswith("_foreach_") or name.endswith("_"):
            continue
        packet = getattr(torch.ops.aten, name)
        for overload in packet.overloads():
            op = getattr(packet, overload)
            if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeExplicitAutograd"):
                table[op] = _foreach_decomposition(op)
    return table
