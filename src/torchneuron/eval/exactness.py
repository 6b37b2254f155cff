"""Judging a float mismatch by the float64 answer.

Where neuron's float32 result differs from CPU's, the exact answer decides:
sums in another order, or a more accurate function, differ from CPU's
float32 by rounding alone. The unit stage judges single ops this way, the
census whole models."""

from __future__ import annotations

import torch


def as_close_as_cpu(got: torch.Tensor, expected: torch.Tensor, exact: torch.Tensor) -> bool:
    """Whether `got` (neuron's) is within twice CPU's own largest error of the
    float64 answer `exact`, plus float32 rounding of its magnitude, with the
    same non-finite elements."""
    if not expected.dtype.is_floating_point or got.shape != exact.shape:
        return False
    x = exact.double()
    finite = torch.isfinite(x)
    g, e = got.cpu().double(), expected.double()
    if not torch.equal(torch.isfinite(g), finite):
        return False
    if not finite.any():
        return True
    cpu_error = (e - x)[finite].abs().max().item()
    device_error = (g - x)[finite].abs().max().item()
    scale = x[finite].abs().max().item()
    return device_error <= 2 * cpu_error + 1e-6 * scale
