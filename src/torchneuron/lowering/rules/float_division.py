"""float32 fmod and floor division exact, as CPU's.

torch-mlir lowers fmod as a - trunc(a / b) * b and floor division as
floor(a / b). Where a / b rounds up to the integer the true quotient falls
short of, fmod came out off by b, with the wrong sign (fmod(-2324.6587,
0.48940185) gave +8.2e-5, CPU -0.48932), and the floor quotient one too
large (about 1 in 8000 random pairs of [-1e4, 1e4] by [0.1, 10]). C's fmod is
exact, and CPU's floor division is built on it (c10's div_floor_floating).
remainder's own lowering is exact where both arguments are non-negative,
so fmod here is the remainder of the magnitudes with a's sign. float16 and
bfloat16 come here through float32.
"""

from __future__ import annotations

import torch

from .double_evaluation import _negative

aten = torch.ops.aten


def _float32_pair(a, b):
    """(a, b) as float32 (a tensor, b a tensor or a float), or None where the
    result is not float32."""
    if not isinstance(a, torch.Tensor) or isinstance(b, bool) or torch.result_type(a, b) != torch.float32:
        return None
    return a.to(torch.float32), b.to(torch.float32) if isinstance(b, torch.Tensor) else float(b)


def _fmod(a, b):
    r = torch.remainder(a.abs(), b.abs() if isinstance(b, torch.Tensor) else abs(b))
    return torch.where(_negative(a), -r, r)  # (-0.0 keeps its sign: fmod(-0, b) is -0)


def fmod(a, b):
    pair = _float32_pair(a, b)
    return NotImplemented if pair is None else _fmod(*pair)


def _floor_divide(a, b):
    """c10's div_floor_floating. A number's sign is decided here: compared in
    the graph it would be a constant splat, which torch-mlir folds wrongly."""
    mod = _fmod(a, b)
    div = (a - mod) / b
    if isinstance(b, torch.Tensor):
        wrong_side = (b < 0) != (mod < 0)
    else:
        wrong_side = (mod > 0) if b < 0 else (mod < 0)
    div = torch.where((mod != 0) & wrong_side, div - 1.0, div)
    floor = torch.floor(div)
    floor = torch.where(div - floor > 0.5, floor + 1.0, floor)
    quotient = a / b
    zero = torch.where(_negative(quotient), torch.full_like(quotient, -0.0), torch.zeros_like(quotient))
    out = torch.where(div != 0, floor, zero)
    if isinstance(b, torch.Tensor):
        return torch.where(b == 0, quotient, out)  # inf or nan, as a / b
    return quotient if b == 0 else out


def divide(a, b, *, rounding_mode=None):
    if rounding_mode != "floor":
        return NotImplemented
    pair = _float32_pair(a, b)
    return NotImplemented if pair is None else _floor_divide(*pair)


def decompositions() -> dict:
    return {aten.fmod.Tensor: fmod, aten.fmod.Scalar: fmod,
            aten.div.Tensor_mode: divide, aten.div.Scalar_mode: divide}
