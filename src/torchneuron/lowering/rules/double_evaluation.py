"""float32 atan, atan2, asin, pow and exp2 evaluated in float64, rounded once.

IREE's float32 expansions of these are 7-70x less accurate than PyTorch's
CPU kernels (largest relative error from the float64 answer over wide
ranges: atan and atan2 4.1e-6, pow of two tensors 3.1e-6, pow with exponent
-1.5 6.1e-7, asin 5.3e-7; CPU's 6-9e-8). A float32 call computes in float64
and rounds its result once, so its error is float32's rounding alone (6e-8):
pow as exp(e log|b|) with C's rules for signs and special values (IREE's
own made a negative base nan even for an integer exponent); atan, atan2
and asin through Cephes' float64 arctangent written out here, since IREE
3.13 leaves float64 atan, atan2 and asin to libm calls its embedded linker
cannot resolve. pow by an exponent CPU multiplies or takes a root for (2,
3, 0.5, -0.5) keeps the lowering's own, exact already; so does a number
raised to a tensor (pow.Scalar): in float64 it made iree-compile crash on
AdamW's step graph (beta ** step over one-element tensors). float16 and
bfloat16 come here through float32.
"""

from __future__ import annotations

import math

import torch

from .special import polevl

aten = torch.ops.aten


def _float32(*tensors) -> bool:
    return all(t.dtype == torch.float32 for t in tensors if isinstance(t, torch.Tensor))


# Cephes' atan (double precision): tan(3 pi / 8), and P/Q for |x| <= 0.66.
_T3P8 = 2.41421356237309504880
_P = (-8.750608600031904122785e-1, -1.615753718733365076637e1, -7.500855792314704667340e1,
      -1.228866684490136173410e2, -6.485021904942025371773e1)
_Q = (2.485846490142306297962e1, 1.650270098316988542046e2, 4.328810604912902668951e2,
      4.853903996359136964868e2, 1.945506571482613964425e2)


def _number(like, value):
    """A float64 tensor of `value` shaped as `like`: a Python number on the
    left of a subtraction (rsub) reaches IREE as a float32 constant."""
    return torch.full_like(like, value)


def _negative(x):
    """x < 0, -0.0 included (torch-mlir does not lower signbit or copysign)."""
    return (x < 0) | ((x == 0) & (1.0 / x < 0))


def _atan_of_magnitude(a):
    """atan(a) for a >= 0 (inf and nan included), float64."""
    large = a > _T3P8
    middle = ~large & (a > 0.66)
    r = torch.where(large, -1.0 / a, torch.where(middle, (a - 1.0) / (a + 1.0), a))
    z = r * r
    p, q = polevl(z, _P), polevl(z, (1.0, *_Q))
    t = r * (z * p / q) + r
    # (a where of two Python numbers would make a float32 tensor)
    return t + torch.where(large, math.pi / 2, torch.where(middle, _number(a, math.pi / 4), 0.0))


def _atan64(x):
    t = _atan_of_magnitude(x.abs())
    return torch.where(_negative(x), -t, t)


def _atan2_64(y, x):
    ax, ay = x.abs(), y.abs()
    swap = ay > ax
    t = _atan_of_magnitude(torch.where(swap, ax, ay) / torch.where(swap, ay, ax))
    t = torch.where(swap, _number(t, math.pi / 2) - t, t)
    t = torch.where(torch.isinf(ax) & torch.isinf(ay), math.pi / 4, t)
    t = torch.where((ax == 0) & (ay == 0), 0.0, t)
    t = torch.where(_negative(x), _number(t, math.pi) - t, t)
    return torch.where(_negative(y), -t, t)


def atan(x):
    if x.dtype != torch.float32:
        return NotImplemented
    return _atan64(x.to(torch.float64)).to(torch.float32)


def atan2(y, x):
    if not (isinstance(y, torch.Tensor) and isinstance(x, torch.Tensor)) or not _float32(y, x):
        return NotImplemented
    return _atan2_64(y.to(torch.float64), x.to(torch.float64)).to(torch.float32)


def asin(x):
    if x.dtype != torch.float32:
        return NotImplemented
    wide = x.to(torch.float64)
    one = _number(wide, 1.0)
    return _atan2_64(wide, torch.sqrt((one - wide) * (one + wide))).to(torch.float32)


def _pow64(b, e):
    """b ** e in float64 with C's pow semantics, which CPU's kernel has:
    |b| ** e as exp(e log|b|) (accurate to float64 for float32 results), the
    sign of a negative base with an odd integer exponent, nan for a finite
    negative base with a fractional one, and 1 for e == 0, b == 1 and
    b == -1 with an infinite e. IREE's own pow made negative bases nan even
    for integer exponents, and 0 ** -1 -inf."""
    m = torch.exp(e * torch.log(b.abs()))
    integer = torch.floor(e) == e  # infinities count as even integers
    negative = _negative(b)
    r = torch.where(negative & integer & (torch.remainder(e, 2.0) == 1.0), -m, m)
    r = torch.where(negative & ~integer & (b != 0) & torch.isfinite(b), _number(r, math.nan), r)
    one = (e == 0) | (b == 1) | ((b == -1) & torch.isinf(e))
    return torch.where(one, _number(r, 1.0), r)


def _pow_tensor_tensor(b, e):
    # (an integer exponent tensor too: IREE's own pow made pow(-2., tensor(2)) nan)
    if not (isinstance(b, torch.Tensor) and isinstance(e, torch.Tensor)) or torch.result_type(b, e) != torch.float32:
        return NotImplemented
    b, e = torch.broadcast_tensors(b.to(torch.float64), e.to(torch.float64))
    return _pow64(b, e).to(torch.float32)


# Exponents CPU's kernel computes by multiplication, a reciprocal, sqrt or
# rsqrt: the lowering's own pow gives CPU's results there.
_EXACT_EXPONENTS = (1.0, 2.0, 3.0, 0.5, -0.5)


def _pow_by_number(x, exponent):
    """x ** exponent for a number (baked into the executable): _pow64's rules
    decided in Python. In tensors they would compare a constant float64
    splat, which torch-mlir folds wrongly (IREE 3.13: a splat of 4.0 compared
    with the integer 0 folded as equal)."""
    if isinstance(exponent, bool) or not isinstance(exponent, (int, float)) or x.dtype != torch.float32:
        return NotImplemented
    e = float(exponent)
    if e in _EXACT_EXPONENTS:
        return NotImplemented
    b = x.to(torch.float64)
    if e == 0:
        return torch.ones_like(x)
    r = torch.exp(torch.log(b.abs()) * _number(b, e))
    integer = math.isinf(e) or e.is_integer()
    negative = _negative(b)
    if integer and not math.isinf(e) and e % 2 == 1:
        r = torch.where(negative, -r, r)
    if not integer:
        r = torch.where(negative & (b != 0) & torch.isfinite(b), _number(r, math.nan), r)
    one = (b.abs() == 1) if math.isinf(e) else (b == 1)
    return torch.where(one, _number(r, 1.0), r).to(torch.float32)


def exp2(x):
    """2 ** x as exp(x ln 2) in float64: in float32 the product's rounding,
    multiplied by up to 88, left 4.1e-6 relative error (CPU 6.9e-8)."""
    if x.dtype != torch.float32:
        return NotImplemented
    wide = x.to(torch.float64)
    return torch.exp(wide * _number(wide, math.log(2.0))).to(torch.float32)


def decompositions() -> dict:
    return {
        aten.exp2.default: exp2,
        aten.atan.default: atan,
        aten.atan2.default: atan2,
        aten.asin.default: asin,
        aten.pow.Tensor_Tensor: _pow_tensor_tensor,
        aten.pow.Tensor_Scalar: _pow_by_number,
    }
