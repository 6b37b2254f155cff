"""Casts to and from the float8 dtypes, bit for bit as PyTorch's CPU casts.

IREE's llvm-cpu codegen converts floats to float8 with its own rules: it
cannot convert float16 to float8 at all (arith.truncf is left illegal), it
writes NaN with another sign bit, it truncates where c10 rounds
float8_e8m0fnu up, and it flushes e8m0fnu's smallest value (2^-127, a
float32 denormal) to zero. So a cast never reaches IREE as a float8 convert:

- from float8: the value's bits built in the target's format (float32,
  float64, bfloat16; other targets cast that float32 with PyTorch's own
  rules) by integer arithmetic, and the few codes where that differs from
  CPU's cast (NaN and infinity patterns, e8m0fnu's ends) replaced by CPU's
  bits, found by running the same arithmetic on the CPU over all 256 codes
  when the graph is traced: exact for every code by construction;
- to float8: c10's conversion from float32 (torch/headeronly/util/Float8_*.h)
  in integer arithmetic on the float32 bits. c10 rounds subnormals by adding
  a power of two in float arithmetic; here that rounding is done on the
  integer mantissa, which gives the same result and cannot be flushed to
  zero by the target's denormal mode. Every other source dtype goes through
  float32 first, as c10's constructors (which take a float) do.
"""

from __future__ import annotations

import functools

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ...compiler import NotCompilable

aten = torch.ops.aten

FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
                 torch.float8_e8m0fnu)


class _Format:
    """c10's from_fp32_value constants for one float8 dtype."""

    def __init__(self, mantissa_bits, bias, smallest_normal_exponent, subnormal_quantum_exponent, overflow_bits,
                 nan_on_overflow, saturated, fnuz):
        self.mantissa_bits = mantissa_bits
        self.bias = bias
        # float32 exponent fields: below `smallest_normal` the result is a subnormal
        self.smallest_normal = smallest_normal_exponent
        self.quantum = subnormal_quantum_exponent  # the subnormals' step is 2^quantum
        self.overflow_bits = overflow_bits  # |x|'s float32 bits at or above which the result is special
        self.nan_on_overflow = nan_on_overflow  # the special result for a finite or infinite |x|
        self.saturated = saturated  # e4m3fn: a rounding to the NaN pattern gives the largest value
        self.fnuz = fnuz  # one NaN (0x80), no negative zero, the sign not applied to overflow


_FORMATS = {
    # mantissa, bias, smallest normal (float32 exponent field), subnormal step, overflow threshold
    torch.float8_e4m3fn: _Format(3, 7, 121, -9, 1087 << 20, 0x7E, True, False),
    torch.float8_e5m2: _Format(2, 15, 113, -16, 143 << 23, 0x7C, False, False),
    torch.float8_e4m3fnuz: _Format(3, 8, 0x78, -10, 0x87 << 23, 0x80, False, True),
    torch.float8_e5m2fnuz: _Format(2, 16, 0x70, -17, 0x8F << 23, 0x80, False, True),
}


def _int(x, value):
    return torch.full_like(x, value)


# torch-mlir lowers only the Tensor-Tensor forms of the shifts and bitwise ops
def _shr(x, n):
    return torch.bitwise_right_shift(x, n if isinstance(n, torch.Tensor) else _int(x, n))


def _shl(x, n):
    return torch.bitwise_left_shift(x, n if isinstance(n, torch.Tensor) else _int(x, n))


def _and(x, mask):
    return torch.bitwise_and(x, _int(x, mask))


def _or(x, mask):
    return torch.bitwise_or(x, _int(x, mask))


def _rounded_right_shift(m, shift):
    """m >> shift, rounded half to even (shift 1..31, m < 2^24)."""
    one = torch.ones_like(m)
    q = _shr(m, shift)
    rem = m - _shl(q, shift)
    half = _shl(one, shift - 1)
    up = (rem > half) | ((rem == half) & (_and(q, 1) == 1))
    return q + up.to(m.dtype)


def _from_float32_bits(bits, fmt: _Format):
    """c10's fp8*_from_fp32_value on int32 float32 bit patterns -> int32 0..255."""
    negative = bits < 0
    f = _and(bits, 0x7FFFFFFF)
    exponent = _shr(f, 23)
    # subnormal results: |x| / 2^quantum rounded half to even on the integer mantissa
    mantissa = _and(f, 0x7FFFFF)
    mantissa = torch.where(exponent > 0, _or(mantissa, 0x800000), mantissa)
    shift = torch.clamp(150 + fmt.quantum - torch.clamp(exponent, min=1), 1, 31)
    subnormal = _and(_rounded_right_shift(mantissa, shift), 0xFF)
    # normal results: c10's add-and-shift rounding (half to even through the odd bit)
    drop = 23 - fmt.mantissa_bits
    odd = _and(_shr(f, drop), 1)
    normal = f + (((fmt.bias - 127) << 23) + (1 << (drop - 1)) - 1) + odd
    normal = _and(_shr(normal, drop), 0xFF)
    if fmt.saturated:
        normal = torch.where(normal == 0x7F, _int(normal, 0x7E), normal)
    finite = torch.where(exponent < fmt.smallest_normal, subnormal, normal)
    if fmt.fnuz:
        result = torch.where(negative & (finite != 0), _or(finite, 0x80), finite)
        return torch.where(f >= fmt.overflow_bits, _int(f, 0x80), result)
    special = torch.where(f > 0x7F800000, _int(f, 0x7F), _int(f, fmt.nan_on_overflow))
    result = torch.where(f >= fmt.overflow_bits, special, finite)
    return torch.where(negative, _or(result, 0x80), result)


def _e8m0_from_float32_bits(bits):
    """c10's fp8e8m0fnu_from_fp32_value: the exponent, rounded up at half
    (to even only between an exponent of 0 and 1), NaN for inf and NaN."""
    exponent = _and(_shr(bits, 23), 0xFF)
    g = _and(bits, 0x400000) != 0
    rest = _and(bits, 0x3FFFFF) != 0
    up = g & (rest | (exponent > 0))
    return torch.where(exponent == 0xFF, exponent, exponent + up.to(exponent.dtype))


def _to_float8(x, dtype):
    wide = x
    if x.dtype != torch.float32:
        x = aten._to_copy.default(x, dtype=torch.float32)
    bits = aten.view.dtype(x, torch.int32)
    if dtype != torch.float8_e8m0fnu:
        code = _from_float32_bits(bits, _FORMATS[dtype])
    else:
        code = _e8m0_from_float32_bits(bits)
        if wide.dtype == torch.float64:
            # float64 -> float32 flushes float32 denormals to zero on the
            # device; CPU's e8m0fnu of such a float32 is 1 above 2^-127
            # (after float32's rounding, half a step of 2^-149 above), else 0
            magnitude = wide.abs()
            tiny = (magnitude > 2.0 ** -127 + 2.0 ** -150).to(code.dtype)
            code = torch.where(magnitude < 2.0 ** -126, tiny, code)
    return aten.view.dtype(aten._to_copy.default(code, dtype=torch.uint8), dtype)


_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}

# The float targets a float8 value is written into bit by bit: (exponent
# bias, mantissa bits, exponent bits). Other targets take the float32 value
# and PyTorch's own cast from float32 (no float8 value is a float32 denormal
# but e8m0fnu's 2^-127, which these three cover, and bool, below).
_WIDENED = {
    torch.float32: (127, 23, 8),
    torch.float64: (1023, 52, 11),
    torch.bfloat16: (127, 7, 8),
}


def _widened_bits(code, source, target):
    """A float8 value's bits in `target` (int64 tensor from int64 codes 0..255),
    right for every finite value that is normal in the target; _exceptions
    corrects the rest."""
    bias, mantissa_bits, exponent_bits = _WIDENED[target]
    if source == torch.float8_e8m0fnu:
        return _shl(code - 127 + bias, mantissa_bits)
    fmt = _FORMATS[source]
    m_bits = fmt.mantissa_bits
    sign = _shl(_shr(code, 7), exponent_bits + mantissa_bits)  # the target's sign bit
    exponent = _and(_shr(code, m_bits), (1 << (7 - m_bits)) - 1)
    mantissa = _and(code, (1 << m_bits) - 1)
    normal = _shl(exponent - fmt.bias + bias, mantissa_bits) + _shl(mantissa, mantissa_bits - m_bits)
    # a float8 subnormal m * 2^(1 - bias - m_bits) is normal in the target:
    # its leading bit p becomes the exponent, the bits below it the mantissa
    lead = torch.where(mantissa >= 4, _int(mantissa, 2), torch.where(mantissa >= 2, _int(mantissa, 1),
                                                                        torch.zeros_like(mantissa)))
    rest = mantissa - _shl(torch.ones_like(mantissa), lead)
    subnormal = _shl(lead + (1 - fmt.bias - m_bits) + bias, mantissa_bits) + _shl(rest, mantissa_bits - lead)
    magnitude = torch.where(exponent > 0, normal, torch.where(mantissa > 0, subnormal, torch.zeros_like(code)))
    return magnitude + sign


def _target_bits(bits, target):
    narrow = _BITS[target.itemsize]
    return bits if bits.dtype == narrow else aten._to_copy.default(bits, dtype=narrow)


@functools.lru_cache(maxsize=None)
def _exceptions(source, target) -> tuple:
    """(code, bits) where _widened_bits differs from CPU's cast: NaN and
    infinity patterns, zero and e8m0fnu's extremes. Found by running the same
    integer arithmetic on the CPU over all 256 codes, so the cast equals
    CPU's on every code by construction."""
    with _disable_current_modes():  # real CPU tensors, not the trace's
        codes = torch.arange(256, dtype=torch.int64)
        ours = _target_bits(_widened_bits(codes, source, target), target)
        cpu = torch.arange(256, dtype=torch.uint8).view(source).to(target).view(_BITS[target.itemsize])
        differ = (ours != cpu).nonzero().flatten().tolist()
        return tuple((code, int(cpu[code])) for code in differ)


def _from_float8(x, dtype):
    code = aten._to_copy.default(aten.view.dtype(x, torch.uint8), dtype=torch.int64)
    if dtype == torch.bool:  # (through float32, e8m0fnu's 2^-127 would be flushed to zero, False)
        if x.dtype == torch.float8_e8m0fnu:
            return torch.ones_like(code, dtype=torch.bool)
        return _and(code, 0xFF if _FORMATS[x.dtype].fnuz else 0x7F) != 0
    through = dtype if dtype in _WIDENED else torch.float32
    bits = _target_bits(_widened_bits(code, x.dtype, through), through)
    for pattern, value in _exceptions(x.dtype, through):
        bits = torch.where(code == pattern, _int(bits, value), bits)
    value = aten.view.dtype(bits, through)
    return value if through == dtype else aten._to_copy.default(value, dtype=dtype)


def to_copy(x, *, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False,
            memory_format=None):
    """aten._to_copy where the source or the result is a float8 dtype;
    NotImplemented otherwise (the other rules and PyTorch's decomposition)."""
    if not isinstance(x, torch.Tensor) or dtype is None or dtype == x.dtype:
        return NotImplemented
    if x.dtype not in FLOAT8_DTYPES and dtype not in FLOAT8_DTYPES:
        return NotImplemented
    if (layout not in (None, torch.strided) or (device is not None and torch.device(device) != x.device)
            or memory_format not in (None, torch.preserve_format, torch.contiguous_format)):
        return NotImplemented
    if x.dtype.is_complex or dtype.is_complex:
        return NotImplemented  # (CPU has no complex <-> float8 cast either)
    if x.dim() == 0:  # (IREE's compiler crashes on a 0-d bit cast; one of shape (1,) compiles)
        return to_copy(x.reshape(1), dtype=dtype).reshape(())
    return _from_float8(x, dtype) if x.dtype in FLOAT8_DTYPES else _to_float8(x, dtype)


def copy(dst, src, non_blocking=False):
    """aten.copy (what copy_ becomes in a graph) between a float8 dtype and
    another: src cast to dst's dtype, broadcast to dst's shape."""
    if not isinstance(src, torch.Tensor) or src.dtype == dst.dtype:
        return NotImplemented
    if src.dtype not in FLOAT8_DTYPES and dst.dtype not in FLOAT8_DTYPES:
        return NotImplemented
    if src.device != dst.device or src.dtype.is_complex or dst.dtype.is_complex:
        return NotImplemented
    return aten.clone.default(aten.expand.default(to_copy(src, dtype=dst.dtype), list(dst.shape)))


def fill(x, value):
    """aten.fill of a float8 tensor: the value, as float32, cast to float8 by
    the rule above (CPU casts the number through float too)."""
    if x.dtype not in FLOAT8_DTYPES:
        return NotImplemented
    if isinstance(value, torch.Tensor):
        wide = aten.expand.default(aten._to_copy.default(value, dtype=torch.float32), list(x.shape))
    else:
        wide = torch.full(x.shape, value, dtype=torch.float32, device=x.device)
    return aten.clone.default(to_copy(wide, dtype=x.dtype))


def scaled_mm(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
    """torch._scaled_mm as CPU computes it (_scaled_mm_out_cpu_emulated): each
    operand in float32 times its scale (tensorwise: one number; rowwise: a's
    [M, 1] and b's [1, N]), a float32 matmul, the bias added in float32, a
    float8 result divided by scale_result, then cast. use_fast_accum changes
    nothing on CPU, nor here. (The meta kernel has checked the shapes and
    the scaling configuration: a call it rejects runs on the host path,
    which raises CPU's error.)"""
    if a.dtype not in FLOAT8_DTYPES or b.dtype not in FLOAT8_DTYPES:
        return NotImplemented
    out_dtype = out_dtype or a.dtype
    wide_a = to_copy(a, dtype=torch.float32) * scale_a
    wide_b = to_copy(b, dtype=torch.float32) * scale_b
    out = torch.mm(wide_a, wide_b)
    if bias is not None:
        out = out + aten._to_copy.default(bias, dtype=torch.float32)
    if scale_result is not None and out_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        out = out * torch.reciprocal(scale_result.reshape(()))
    return out if out_dtype == torch.float32 else aten._to_copy.default(out, dtype=out_dtype)


def decompositions() -> dict:
    return {aten._to_copy.default: to_copy, aten.copy.default: copy, aten.fill.Scalar: fill, aten.fill.Tensor: fill,
            aten._scaled_mm.default: scaled_mm}


# Ops compiled with float8 operands: the casts above and the ops that only
# move, select or fill float8 values (CPU has float8 kernels for each; the
# compiled form moves bits, so it cannot round differently). Any other op
# with a float8 operand runs on the host path, so it computes what CPU's
# kernel computes or raises CPU's own error ("add_stub" not implemented for
# 'Float8_e4m3fn'), rather than compiling IREE's float8 arithmetic, which CPU
# does not have. (Not here: flip, which CPU refuses along some dimensions, and
# constant_pad_nd, which IREE 3.13 fails to compile for float8.)
_MOVES_VALUES = (
    "_to_copy.default", "copy.default", "copy_.default", "clone.default", "cat.default", "stack.default",
    "fill.Scalar", "fill_.Scalar", "fill.Tensor", "fill_.Tensor", "zero_.default", "zeros_like.default",
    "index_select.default", "index.Tensor", "index_put.default", "index_put_.default",
    "_index_put_impl_.default", "where.self", "roll.default", "repeat.default",
    "slice_scatter.default", "select_scatter.default", "narrow_copy.default", "expand_copy.default",
    "permute_copy.default", "view_copy.default", "view_copy.dtype", "_unsafe_view.default", "slice_copy.Tensor",
    "transpose_copy.int", "unfold_copy.default", "diagonal_copy.default", "_reshape_copy.default",
    "as_strided_copy.default", "alias_copy.default", "t_copy.default", "unsqueeze_copy.default",
    "squeeze_copy.dims", "select_copy.int", "split_with_sizes_copy.default", "unbind_copy.int",
    "_scaled_mm.default",  # (its own rule above: in float32, as CPU's)
)


@functools.lru_cache(maxsize=None)
def compiles_with_float8_operands(op) -> bool:
    if not isinstance(op, torch._ops.OpOverload):
        return False
    schema = op._schema
    if schema.returns and all(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
        return True  # a view
    return f"{schema.name.split('::')[-1]}.{schema.overload_name or 'default'}" in _MOVES_VALUES


def refuse_float8_operands(op, dtypes) -> None:
    """Raise NotCompilable when `op` has a float8 operand it is not compiled with."""
    if any(d in FLOAT8_DTYPES for d in dtypes) and not compiles_with_float8_operands(op):
        raise NotCompilable("float8 operands: only casts and ops that move float8 values are compiled "
                            "(CPU's kernel runs the rest, or raises CPU's error)")


def refuse_float8_graph(gm: torch.fx.GraphModule) -> None:
    """refuse_float8_operands for each op of an FX graph (torch.compile's)."""
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        dtypes = [a.meta["val"].dtype for a in node.all_input_nodes
                  if isinstance(a.meta.get("val"), torch.Tensor)]
        refuse_float8_operands(node.target, dtypes)
