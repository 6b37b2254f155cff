"""fmod, remainder and floor division give CPU's exact results
(lowering/rules/float_division.py): fmod was off by the divisor with the wrong sign,
and the floor quotient one too large, where a / b rounds up to an integer."""

import pytest
import torch

import torchneuron  # noqa: F401
from torchneuron.dispatch import stats as dispatch_stats

_OPS = {
    "fmod": torch.fmod,
    "remainder": torch.remainder,
    "floor": lambda a, b: torch.div(a, b, rounding_mode="floor"),
    "trunc": lambda a, b: torch.div(a, b, rounding_mode="trunc"),
    "floor_divide": torch.floor_divide,
    "operators": lambda a, b: (a // b) + (a % b) * 0.5,
}


def _pairs():
    gen = torch.Generator().manual_seed(0)
    a = torch.rand(1 << 16, generator=gen) * 2e4 - 1e4
    b = (torch.rand(1 << 16, generator=gen) * 9.9 + 0.1) * torch.where(torch.rand(1 << 16, generator=gen) < 0.5, -1, 1)
    return a, b


def _same(got, expected):
    """Equal bit for bit up to nan's sign: values and signs of zeros."""
    numbers = ~torch.isnan(expected)
    return (torch.equal(torch.isnan(got), torch.isnan(expected)) and torch.equal(got[numbers], expected[numbers])
            and torch.equal(torch.signbit(got)[numbers], torch.signbit(expected)[numbers]))


@pytest.mark.parametrize("name", sorted(_OPS))
def test_float32_results_equal_cpus_exactly(name):
    fn = _OPS[name]
    a, b = _pairs()
    before = a.clone(), b.clone()
    got = fn(a.to("neuron"), b.to("neuron")).cpu()
    assert torch.equal(a, before[0]) and torch.equal(b, before[1])
    expected = fn(a, b)
    assert torch.equal(got, expected), f"{(got != expected).sum().item()} of {a.numel()} differ"
    # by a number, and a number by a tensor
    assert torch.equal(fn(a.to("neuron"), 0.7).cpu(), fn(a, 0.7))
    assert torch.equal(fn(a.to("neuron"), -3).cpu(), fn(a, -3))


@pytest.mark.parametrize("name", sorted(_OPS))
def test_special_values_and_signed_zeros_as_cpu(name):
    fn = _OPS[name]
    values = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1.5, -2.0, 1e-30, 3.0, -3.0, 7.5,
                           -1e-30, 6.0, -6.0])
    a, b = values.repeat_interleave(len(values)), values.repeat(len(values))
    got, expected = fn(a.to("neuron"), b.to("neuron")).cpu(), fn(a, b)
    assert _same(got, expected), [(x.item(), y.item(), g.item(), e.item()) for x, y, g, e in zip(a, b, got, expected)
                                  if not _same(g.view(1), e.view(1))]


@pytest.mark.op_mode
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int64, torch.int32])
def test_other_dtypes_compile_and_match_cpu(dtype):
    a, b = _pairs()
    if dtype.is_floating_point:
        a, b = (a / 100).to(dtype), b.to(dtype)
    else:
        a, b = a.to(dtype), (b.round() + torch.where(b < 0, -1, 1)).to(dtype)
    before = dict(dispatch_stats.host_fallback)
    for name in ("fmod", "remainder", "floor", "trunc", "floor_divide"):
        got, expected = _OPS[name](a.to("neuron"), b.to("neuron")).cpu(), _OPS[name](a, b)
        if dtype.is_floating_point and name in ("floor", "floor_divide", "trunc"):
            # CPU's half kernels round steps to the half type and can miss by one:
            # floor division (-78.4375 // -0.10467529 is floor(749.34): CPU float16
            # 748), trunc of the quotient rounded first (2.99 -> 3). Neuron computes
            # in float32 and gives the exact answer's.
            exact = _OPS[name](a.double(), b.double()).to(dtype)
            assert torch.equal(got, exact), (name, (got != exact).sum().item())
        else:
            assert torch.equal(got, expected), (name, (got != expected).sum().item())
    assert dict(dispatch_stats.host_fallback) == before, dispatch_stats.host_fallback
