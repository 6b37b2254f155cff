"""uint8 arithmetic in int32, as CPU computes it.

torch-mlir lowers many ops on uint8 tensors as if their bytes were signed:
values above 127 sorted below 0 (sort, topk, searchsorted), remainders,
divisions and absolute values taken of the negative number, sums and
products accumulated in 8 bits before they were widened to int64
(uint8 [4, 9] rows summed to 129 where CPU says 1153), clamp to a uint8
tensor bound compared signed. Casts from uint8 are right, so these ops take
their uint8 operands widened to int32 (exact: every uint8 value is an int32
value) and give back uint8 where CPU's result is uint8: truncating an int32
result to 8 bits is CPU's own wrap-around for uint8 arithmetic. bool
operands likewise (torch-mlir's i1 compares signed: True sorted below False).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _disable_current_modes

aten = torch.ops.aten

_SIGN_SENSITIVE = (
    aten.sort.default, aten.sort.stable, aten.topk.default,
    aten.clamp.Tensor, aten.clamp_min.Tensor, aten.clamp_max.Tensor,
    aten.div.Tensor, aten.div.Scalar, aten.div.Tensor_mode, aten.div.Scalar_mode,
    aten.remainder.Tensor, aten.remainder.Scalar, aten.fmod.Tensor, aten.fmod.Scalar,
    aten.abs.default, aten.sum.default, aten.sum.dim_IntList, aten.prod.default, aten.prod.dim_int,
    aten.searchsorted.Tensor, aten.searchsorted.Scalar, aten.bucketize.Tensor,
)


# (bool too: an i1 compares as signed, True below False)
_UNSIGNED = (torch.uint8, torch.bool)


def _has_uint8(values) -> bool:
    return any(isinstance(v, torch.Tensor) and v.dtype in _UNSIGNED for v in values)


def _widened(value):
    if isinstance(value, torch.Tensor) and value.dtype in _UNSIGNED:
        return value.to(torch.int32)
    return value


def _result_dtypes(op, args, kwargs):
    """The dtypes of CPU's results for these arguments (run on meta tensors)."""
    def meta(v):
        if isinstance(v, torch.Tensor):
            return torch.empty(tuple(v.shape), dtype=v.dtype, device="meta")
        return v

    with _disable_current_modes():
        result = op(*[meta(a) for a in args], **{k: meta(v) for k, v in kwargs.items()})
    results = result if isinstance(result, (tuple, list)) else (result,)
    return [r.dtype if isinstance(r, torch.Tensor) else None for r in results]


def in_int32(op, existing):
    """The rule for `op`: uint8 operands widened; other calls go to `existing`."""
    def decompose(*args, **kwargs):
        if not _has_uint8((*args, *kwargs.values())):
            return existing(*args, **kwargs) if existing is not None else NotImplemented
        if op is aten.topk.default and args[0].dtype == torch.bool:
            # CPU refuses (its meta kernel does not): the host path gives CPU's error
            raise NotImplementedError("topk does not support bool dtypes on CPU")
        wanted = _result_dtypes(op, args, kwargs)
        result = op(*[_widened(a) for a in args], **{k: _widened(v) for k, v in kwargs.items()})
        results = result if isinstance(result, (tuple, list)) else (result,)
        narrowed = [r.to(d) if isinstance(r, torch.Tensor) and d is not None and r.dtype != d else r
                    for r, d in zip(results, wanted)]
        return type(result)(narrowed) if isinstance(result, (tuple, list)) else narrowed[0]

    return decompose


def rules(table: dict) -> dict:
    """This module's rules over the table's existing ones."""
    return {op: in_int32(op, table.get(op)) for op in _SIGN_SENSITIVE}
