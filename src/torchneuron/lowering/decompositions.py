"""The decomposition table applied before import: PyTorch's core ATen set,
plus the multi-tensor (_foreach_) ops, which torch-mlir does not know: they
are traced through PyTorch's own per-tensor kernels into one graph."""

from __future__ import annotations

import functools
import math

import torch
from torch._decomp import core_aten_decompositions, decomposition_table as _all_decompositions

from .rules import (amp, convolution_backward, convolution_products, depthwise_taps, double_evaluation, float8,
                    float32_moments, float_division, hyperbolic, interpolation_backward, linalg, long_convolutions,
                    long_scans, long_sums, nan_propagation, order_statistics, rnn_cells, softmax_rows, special, split_k,
                    tensor_ops, trigonometry, unsigned_bytes)

_PER_TENSOR = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


def _foreach_decomposition(op):
    def decompose(*args, **kwargs):
        # The CPU slot of a _foreach_ op holds its per-tensor composite kernel.
        return op.redispatch(_PER_TENSOR, *args, **kwargs)

    return decompose


def _first_of(*rules):
    """The first of `rules` that does not return NotImplemented."""

    def decompose(*args, **kwargs):
        for rule in rules:
            result = rule(*args, **kwargs)
            if result is not NotImplemented:
                return result
        return NotImplemented

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


# The type PyTorch's CPU kernels carry a scan's running value in (at::acc_type).
_SCAN_CARRY = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.float32: torch.float64}


def _scan_as_cpu(op):
    """cumsum/cumprod carry the running value as PyTorch's CPU kernels do
    (at::acc_type: float64 for float32, float32 for float16/bfloat16) and round
    each output once; IREE would carry it in the output's type (a bfloat16
    cumsum of 5 terms was 5% off CPU's, a float32 cumsum of 100000 terms 200x
    further from the float64 answer than CPU's)."""

    def decompose(x, dim, *, dtype=None):
        target = dtype or x.dtype
        carry = _SCAN_CARRY.get(target)
        if carry is None:
            return NotImplemented
        return op(x.to(target).to(carry), dim).to(target)

    return decompose


def _normalization_in_float32(op):
    """native_layer_norm / native_group_norm of float16/bfloat16: moments and
    normalization in float32, each result rounded once, as PyTorch's CPU
    kernels do; IREE would compute them in the narrow type. With float32
    weight or bias ("mixed") CPU keeps the moments float32 (PyTorch's
    reference rounds them to the input's type on CPU devices, which CPU's
    kernels do not). Both ops take (input, ..., weight, bias, ...) with the
    parameters at positions 1-2 (group norm) or 2-3 (layer norm)."""
    at = 2 if op is torch.ops.aten.native_layer_norm.default else 1

    def decompose(x, *args):
        params = [t for t in args[at - 1:at + 1] if t is not None]
        if x.dtype not in _LOW_PRECISION or any(t.dtype not in (x.dtype, torch.float32) for t in params):
            return NotImplemented
        mixed = any(t.dtype == torch.float32 for t in params)
        up = [a.to(torch.float32) if isinstance(a, torch.Tensor) else a for a in args]
        out, mean, rstd = op(x.to(torch.float32), *up)
        if mixed:
            return out.to(x.dtype), mean, rstd
        return out.to(x.dtype), mean.to(x.dtype), rstd.to(x.dtype)

    return decompose


def _rounded_to(x, low):
    """float32 x rounded to `low` (round to nearest even), still float32.
    Inside one dispatch IREE's CPU codegen drops a bfloat16 truncf/extf pair
    (it computes bfloat16 arithmetic in float32), so bfloat16 rounds on the
    bits; a float16 pair is kept."""
    if low != torch.bfloat16:
        return x.to(low).to(torch.float32)
    bits = x.view(torch.int32)
    bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -0x10000
    return torch.where(torch.isnan(x), x, bits.view(torch.float32))


def _log_softmax_as_cpu(existing):
    """bfloat16 log_softmax over the last dimension rounds where PyTorch's CPU
    kernel (serial_vec_log_softmax_lastdim_range) does: the float32 sum of
    exp(x - max) and its log are each stored as bfloat16, then x - max -
    log(sum) is computed in float32 and rounded once (a row whose sum rounds
    to 1 gives exactly 0 at its max: 4e-3 from float32's answer, beyond PyTorch's
    device-vs-CPU tolerance). float16 (whose CPU kernel rounds the same way,
    2e-4 off, within that tolerance) and other dimensions compute in float32
    and round once (PyTorch's decomposition), as CUDA does: rounding float16's
    sum too took the float16-autocast demo GPT (cross_entropy's log_softmax is
    float16 there) 2.4% from float32 in 20 steps."""

    def decompose(x, dim, half_to_float):
        last = x.dim() == 0 or dim % x.dim() == x.dim() - 1
        if x.dtype != torch.bfloat16 or half_to_float or not last or x.numel() == 0:
            return existing(x, dim, half_to_float)
        xf = x.to(torch.float32)
        shifted = xf - torch.amax(xf, dim, keepdim=True)
        total = _rounded_to(torch.sum(torch.exp(shifted), dim, keepdim=True), x.dtype)
        return (shifted - _rounded_to(torch.log(total), x.dtype)).to(x.dtype)

    return decompose


def _batch_norm_as_cpu(op):
    """native_batch_norm / _batch_norm_with_update of float16/bfloat16
    (parameters of the same type or none) normalize as PyTorch's CPU kernel:
    in training the batch mean and 1/sqrt(var + eps) are stored in the
    input's type first (CPU's save_mean and save_invstd), in evaluation the
    running statistics serve as they are; then x * a + b, a = invstd * weight,
    b = bias - mean * a, in float32, rounded once. The saved statistics and
    running updates stay PyTorch's. With float32 parameters ("mixed") CPU
    computes and keeps the statistics in float32: so does this."""

    def decompose(x, weight, bias, running_mean, running_var, *rest):
        # native_batch_norm: (..., training, momentum, eps); _batch_norm_with_update: (..., momentum, eps)
        training, eps = (rest[0] if len(rest) == 3 else True), rest[-1]
        params = [t for t in (weight, bias, running_mean, running_var) if t is not None]
        if x.dtype in _LOW_PRECISION and params and all(t.dtype == torch.float32 for t in params):
            # Mixed (CPU's kernel keeps the statistics float32): all in float32, the output rounded once.
            out, *saved = op(x.to(torch.float32), weight, bias, running_mean, running_var, *rest)
            return (out.to(x.dtype), *saved)
        result = op(x, weight, bias, running_mean, running_var, *rest)
        if x.dtype not in _LOW_PRECISION or any(t.dtype != x.dtype for t in params) or x.numel() == 0:
            return result
        xf = x.to(torch.float32)
        if training or running_mean is None:
            var, mean = torch.var_mean(xf, [0, *range(2, x.dim())], correction=0)
            mean, invstd = _rounded_to(mean, x.dtype), _rounded_to(1.0 / torch.sqrt(var + eps), x.dtype)
        else:
            mean, invstd = running_mean.to(torch.float32), 1.0 / torch.sqrt(running_var.to(torch.float32) + eps)
        alpha = invstd if weight is None else invstd * weight.to(torch.float32)
        beta = -mean * alpha if bias is None else bias.to(torch.float32) - mean * alpha
        shape = [1, -1] + [1] * (x.dim() - 2)
        out = (xf * alpha.reshape(shape) + beta.reshape(shape)).to(x.dtype)
        return (out, *result[1:])

    return decompose


def _batch_norm_without_running_statistics(x, weight, bias, training, momentum, eps):
    """_native_batch_norm_legit.no_stats: the batch norm above with no running statistics."""
    return _batch_norm_as_cpu(torch.ops.aten.native_batch_norm.default)(
        x, weight, bias, None, None, training, momentum, eps)


def _gelu_tanh(x, approximate="none"):
    """GELU's tanh approximation with PyTorch's constants: torch-mlir's
    lowering takes 0.7977240352174656 for sqrt(2/pi) (0.7978845608...),
    5e-5 off CPU in float32 and 2 ulps in float16."""
    if approximate != "tanh":
        return NotImplemented
    beta = math.sqrt(2.0 / math.pi)
    inner = beta * (x + 0.044715 * (x * x * x))
    return 0.5 * x * (1.0 + torch.tanh(inner))


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


def _negate_integers(x):
    """-x of an integer tensor as 0 - x: torch-mlir's neg went through float32
    (-(2**31 - 1) gave -2**31, int64 kept 24 bits)."""
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        return NotImplemented
    return torch.zeros_like(x) - x


def _elu_with_expm1(x, alpha=1, scale=1, input_scale=1):
    """elu (and selu and celu, which PyTorch expresses through it) with expm1 on
    the negative side, as CPU's kernel: exp(x) - 1 cancels near 0 (selu 1.1e-4
    relative off, elu 1.7e-5; CPU 6e-8 to 1.2e-7)."""
    if not x.dtype.is_floating_point:
        return NotImplemented
    return torch.where(x > 0, x * scale, torch.expm1(x * input_scale) * (alpha * scale))


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
    table.update(interpolation_backward.decompositions())
    return table


@functools.lru_cache(maxsize=None)
def direct_decompositions() -> dict:
    """What the lowering calls in place of the op: the decompositions above,
    plus rewrites that end in the op itself (not for the export's table)."""
    table = dict(own_decompositions())
    table.update(tensor_ops.direct_rewrites())
    for op in (torch.ops.aten.native_batch_norm.default, torch.ops.aten._batch_norm_with_update.default,
               torch.ops.aten._native_batch_norm_legit.default):
        table[op] = _batch_norm_as_cpu(op)
    table[torch.ops.aten._native_batch_norm_legit.no_stats] = _batch_norm_without_running_statistics
    # Ops with a CPU kernel and a composite one reach the backend whole, and
    # torch.export keeps them whole, which torch-mlir does not lower: trace
    # PyTorch's decomposition instead (the upsamplings and batch norm have
    # their own above).
    for op in (torch.ops.aten.silu_backward.default, torch.ops.aten.mish_backward.default):
        table.setdefault(op, _all_decompositions[op])
    return table


# Ops torch-mlir lowers to slices of tensors, whose PyTorch decompositions
# end in as_strided, which the importer turns into a gather through constant
# int64 index tensors as large as the result (a fused backward graph of the
# demo was 11 MB of MLIR). (select_scatter stays decomposed: torch-mlir's
# does not wrap a negative index, tests/test_index_bounds.py.)
_LOWERED_WHOLE = (torch.ops.aten.slice.Tensor, torch.ops.aten.slice_scatter.default)


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
    for op in _LOWERED_WHOLE:
        table.pop(op, None)
    table.update(_view_copies())
    table[torch.ops.aten.squeeze.dims] = _squeeze_dims
    table[torch.ops.aten.log10.default] = _log10
    for op in (torch.ops.aten.sum.default, torch.ops.aten.sum.dim_IntList, torch.ops.aten.mean.default,
               torch.ops.aten.mean.dim, torch.ops.aten.linalg_vector_norm.default):
        table[op] = long_sums.in_blocks(op, _accumulate_in_float32(op))
    scans = long_scans.decompositions()  # GPU targets only
    for op in (torch.ops.aten.cumsum.default, torch.ops.aten.cumprod.default):
        table[op] = _first_of(_scan_as_cpu(op), scans[op])
    # float32 only (NotImplemented otherwise: traced as the op); float16 and
    # bfloat16 reach them through _in_float32 below.
    table.update(trigonometry.decompositions())
    table.update(hyperbolic.decompositions())
    table.update(double_evaluation.decompositions())
    for module in (float_division, nan_propagation, order_statistics):  # (other calls keep PyTorch's decomposition, if any)
        for op, rule in module.decompositions().items():
            table[op] = _first_of(rule, table[op]) if op in table else rule
    table[torch.ops.aten.neg.default] = _negate_integers
    for op, rule in float8.decompositions().items():  # casts to and from float8, bit for bit as CPU's
        table[op] = _first_of(rule, table[op]) if op in table else rule
    moments = float32_moments.decompositions()  # float32 moments in float32 on GPU targets
    for op in (torch.ops.aten.native_layer_norm.default, torch.ops.aten.native_group_norm.default):
        table[op] = _first_of(_normalization_in_float32(op), moments[op]) if op in moments \
            else _normalization_in_float32(op)
    for op in (torch.ops.aten.var.correction, torch.ops.aten.var_mean.correction):
        table[op] = _in_float32(op, moments[op])  # CPU's moments accumulate in float32 too
    table[torch.ops.aten._log_softmax.default] = _log_softmax_as_cpu(table[torch.ops.aten._log_softmax.default])
    for op in (torch.ops.aten._softmax.default, torch.ops.aten._log_softmax.default):
        table[op] = softmax_rows.rows_in_groups(table[op])
    table[torch.ops.aten.gelu.default] = _gelu_tanh
    table[torch.ops.aten.elu.default] = _elu_with_expm1
    table.update(split_k.rules())
    table[torch.ops.aten.convolution.default] = _first_of(depthwise_taps.convolution,  # GPU targets only
                                                          convolution_products.convolution,
                                                          long_convolutions.convolution,
                                                          convolution_backward.grouped_transposed_convolution)
    table.update(convolution_backward.rules())
    table[torch.ops.aten.index_put.default] = tensor_ops.index_put_by_mask  # graphs' boolean masks
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
    table.update(unsigned_bytes.rules(table))  # uint8 operands in int32, over every rule above
    return table
