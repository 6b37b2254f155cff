"""float32 sin, cos and tan as accurate as PyTorch's CPU kernels.

IREE's llvm-cpu expansion of float32 sin/cos reduces the argument with
float32 constants and evaluates a polynomial that is inaccurate near zero:
measured against float64, CPU's results are within 6.5e-8 relative error
everywhere, IREE's were 4.3e-3 off for |x| < 1 (sin of small x), 1 to 11 off
near the zeros of sin and cos for |x| < 10, and up to 1e4 relative (2.8e-3
absolute) for |x| < 1e5; its tan returned inf near the poles (rotary
embeddings take cos and sin of position x frequency, thousands of radians).

Here the argument is reduced in float64 arithmetic (k = round(x * 2/pi),
r = x - k * pi/2 with pi/2 in three parts: exact for |x| < 2^20 * pi/2,
about 1.6e6; beyond, the results lose accuracy as CPU's would not) and
Cephes' float32 minimax polynomials on |r| <= pi/4 give sin r and cos r,
combined by the quadrant k mod 4 (tan as their quotient: Cephes' own tan
polynomial made IREE's compiler hang on a one-element tensor). Only float64 multiply, subtract and
round are needed, which the device compiles (its float64 sin would not: it
runs on the host). float16 and bfloat16 come here through float32.
"""

from __future__ import annotations

import math

import torch

aten = torch.ops.aten


# pi/2 in three parts (fdlibm's __ieee754_rem_pio2): the first two have 33
# significant bits, so k * part is exact in float64 for |k| < 2^20 and the
# subtractions lose nothing where x lies near a multiple of pi/2 (a single
# float64 pi/2 was 1.3e-5 off, relatively, near sin's zeros around 1e5).
_PIO2_1 = 1.57079632673412561417e+00
_PIO2_2 = 6.07710050630396597660e-11
_PIO2_2T = 2.02226624879595063154e-21


def _reduced(x):
    """(r, quadrant): x = r + k * pi/2 with |r| <= pi/4, quadrant = k mod 4."""
    wide = x.to(torch.float64)
    k = torch.floor(wide * (2 / math.pi) + 0.5)  # nearest (floor: a vector instruction, round was not)
    r = ((wide - k * _PIO2_1) - k * _PIO2_2) - k * _PIO2_2T
    return r.to(torch.float32), torch.bitwise_and(k.to(torch.int32), 3)  # k mod 4, negative k too


def _sin_poly(r):
    z = r * r
    return ((-1.9515295891e-4 * z + 8.3321608736e-3) * z - 1.6666654611e-1) * z * r + r


def _cos_poly(r):
    z = r * r
    return ((2.443315711809948e-5 * z - 1.388731625493765e-3) * z + 4.166664568298827e-2) * z * z - 0.5 * z + 1.0


def _pick(quadrant, first, second, third, fourth):
    return torch.where(quadrant == 0, first, torch.where(quadrant == 1, second,
                                                         torch.where(quadrant == 2, third, fourth)))


def sin(x):
    if x.dtype != torch.float32:
        return NotImplemented
    r, q = _reduced(x)
    s, c = _sin_poly(r), _cos_poly(r)
    return torch.where(x == 0, x, torch.where(torch.isfinite(x), _pick(q, s, c, -s, -c), x - x))  # +-0 kept; inf: nan


def cos(x):
    if x.dtype != torch.float32:
        return NotImplemented
    r, q = _reduced(x)
    s, c = _sin_poly(r), _cos_poly(r)
    return torch.where(torch.isfinite(x), _pick(q, c, -s, -c, s), x - x)


def tan(x):
    if x.dtype != torch.float32:
        return NotImplemented
    r, q = _reduced(x)
    s, c = _sin_poly(r), _cos_poly(r)
    odd = torch.bitwise_and(q, 1) == 1
    return torch.where(x == 0, x, torch.where(torch.isfinite(x), torch.where(odd, -c, s) / torch.where(odd, s, c), x - x))


def decompositions() -> dict:
    return {aten.sin.default: sin, aten.cos.default: cos, aten.tan.default: tan}
