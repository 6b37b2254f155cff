"""Judging a float mismatch by the float64 answer.

Where neuron's float32 result differs from CPU's, the exact answer decides:
sums in another order, or a more accurate function, differ from CPU's
float32 by rounding alone. The unit stage judges single ops this way, the
census whole models, the OpInfo conformance run each sample."""

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


def in_float64(value):
    """`value` with its float32/float16/bfloat16 tensors as float64 copies
    (through lists, tuples and dicts): the arguments of the exact answer."""
    if isinstance(value, torch.Tensor):
        return value.double() if value.dtype in (torch.float32, torch.float16, torch.bfloat16) else value
    if isinstance(value, (list, tuple)):
        return type(value)(in_float64(v) for v in value)
    if isinstance(value, dict):
        return {k: in_float64(v) for k, v in value.items()}
    return value


def mismatches_as_close_as_cpu(got: list, expected: list, exact: list, close) -> bool:
    """Whether every result of `got` that `close(got, expected)` rejects
    (raises AssertionError) is a float tensor of CPU's dtype within twice
    CPU's error of the float64 answer (as_close_as_cpu). Results within the
    usual tolerance pass as they are (a convolution's bias gradient need not
    beat CPU's sum when its weight gradient is the one judged); any other
    mismatch fails."""
    if not (len(got) == len(expected) == len(exact)):
        return False
    for g, e, x in zip(got, expected, exact):
        try:
            close(g, e)
            continue
        except AssertionError:
            pass
        if not (isinstance(g, torch.Tensor) and isinstance(e, torch.Tensor) and isinstance(x, torch.Tensor)
                and g.dtype == e.dtype and as_close_as_cpu(g, e, x)):
            return False  # another dtype (a float32 mean for a bfloat16 input) is not a rounding matter
    return True
