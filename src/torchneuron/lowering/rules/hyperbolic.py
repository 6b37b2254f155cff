"""float32 asinh, atanh, sinh and acosh within 3x the error of PyTorch's CPU kernels.

IREE expands them from their textbook formulas in float32, which cancel:
asinh(x) = log(x + sqrt(x^2 + 1)) gave -inf for x = -1e4, inf for 1e20 and
asinh(1e-6) 4.6% off; atanh(1e-6) was 1.3% off, sinh(1e-6) 1.7% and acosh
near 1 6.3e-7.
Here they are fdlibm's formulations on |x| with the sign copied back, built
on log1p, expm1, log and exp, which IREE computes within 2e-7 relative
error. Every branch is computed and the right one selected (no control
flow in a compiled graph); float16 and bfloat16 come here through float32.
"""

from __future__ import annotations

import math

import torch

aten = torch.ops.aten

_LN2 = math.log(2.0)


def _with_sign_of(r, x):
    """r (a function of |x|, zero at zero) with x's sign, signed zeros kept
    (torch-mlir does not lower copysign)."""
    return torch.where(x == 0, x, torch.where(x < 0, -r, r))


def asinh(x):
    if x.dtype != torch.float32:
        return NotImplemented
    a = x.abs()
    # fdlibm's |x| < 2 formula serves up to 2^13 as accurately (every term is positive);
    # its separate 2 <= |x| < 2^13 branch made IREE's compiler loop on a one-element tensor.
    moderate = torch.log1p(a + a * a / (1.0 + torch.sqrt(1.0 + a * a)))
    large = torch.log(a) + _LN2  # sqrt(x^2 + 1) is |x| to float32's precision (and x^2 may overflow)
    r = torch.where(a < 8192.0, moderate, large)
    return _with_sign_of(r, x)


def atanh(x):
    if x.dtype != torch.float32:
        return NotImplemented
    a = x.abs()
    t = a + a
    r = torch.where(a < 0.5, 0.5 * torch.log1p(t + t * a / (1.0 - a)), 0.5 * torch.log1p(t / (1.0 - a)))
    return _with_sign_of(r, x)


def sinh(x):
    if x.dtype != torch.float32:
        return NotImplemented
    a = x.abs()
    t = torch.expm1(a)
    half = torch.exp(0.5 * a)  # e^|x| / 2 as (e^(|x|/2) / 2) * e^(|x|/2): finite up to sinh's own limit
    r = torch.where(a < 1.0, 0.5 * (2.0 * t - t * t / (t + 1.0)),
                    torch.where(a < 20.0, 0.5 * (t + t / (t + 1.0)), (0.5 * half) * half))
    return _with_sign_of(r, x)


def acosh(x):
    """fdlibm's three ranges: log(x + sqrt(x^2 - 1)) cancels near 1 (6.3e-7
    relative off; CPU 1e-7), and x^2 overflows past 1.8e19."""
    if x.dtype != torch.float32:
        return NotImplemented
    t = x - 1.0
    near = torch.log1p(t + torch.sqrt(2.0 * t + t * t))
    moderate = torch.log(2.0 * x - 1.0 / (x + torch.sqrt(x * x - 1.0)))
    large = torch.log(x) + _LN2
    r = torch.where(x < 2.0, near, torch.where(x < 268435456.0, moderate, large))
    return torch.where(x < 1.0, torch.full_like(x, math.nan), r)  # nan stays nan (the comparisons are false)


def decompositions() -> dict:
    return {aten.asinh.default: asinh, aten.atanh.default: atanh, aten.sinh.default: sinh, aten.acosh.default: acosh}
