"""NaN in, NaN out, as CPU (lowering/rules/nan_propagation.py): clamp and its
relatives, binary max/min, argmax/argmin and max/min over a dimension, sort
and topk; and integer negation exact (it went through float32)."""

import pytest
import torch
import torch.nn.functional as F

import torchneuron  # noqa: F401
from torchneuron.dispatch import stats as dispatch_stats

nan, inf = float("nan"), float("inf")


def _values():
    x = torch.tensor([nan, -2.0, 0.5, nan, 3.0, -inf, inf, 7.0, -0.0, 0.0, 2.0, -2.0])
    y = torch.tensor([1.0, nan, nan, 2.0, -1.0, nan, 0.0, 8.0, 0.0, 3.0, 2.0, nan])
    return x, y


def _rows():
    return torch.tensor([[1.0, nan, 3.0, 2.0, 3.0, 1.0], [nan, nan, nan, nan, nan, nan],
                         [2.0, 2.0, 1.0, 5.0, 5.0, 1.0], [-inf, inf, 0.0, nan, inf, -inf],
                         [-inf, -inf, -inf, -inf, -inf, -inf], [4.0, -1.0, 0.0, -0.0, 2.5, 4.0]])


_ELEMENTWISE = {
    "clamp": lambda x, y: torch.clamp(x, -1, 1),
    "clamp_min": lambda x, y: torch.clamp(x, min=0),
    "clamp_max": lambda x, y: torch.clamp(x, max=0),
    "clamp by tensors": lambda x, y: torch.clamp(x, min=y, max=y + 4),
    "clamp_min tensor": lambda x, y: torch.clamp_min(x, y),
    "clip": lambda x, y: torch.clip(x, -1, 1),
    "maximum": torch.maximum,
    "minimum": torch.minimum,
    "max of two": torch.max,
    "relu6": lambda x, y: F.relu6(x),
    "hardtanh": lambda x, y: F.hardtanh(x, -2, 2),
    "hardsigmoid": lambda x, y: F.hardsigmoid(x),
}
_REDUCTIONS = {
    "argmax": lambda m: torch.argmax(m, 1),
    "argmin": lambda m: torch.argmin(m, 1),
    "argmax all": lambda m: torch.argmax(m),
    "argmin keepdim": lambda m: torch.argmin(m, keepdim=True),
    "argmax dim 0": lambda m: torch.argmax(m, 0, keepdim=True),
    "max dim": lambda m: torch.max(m, 1),
    "min dim": lambda m: torch.min(m, 0, keepdim=True),
    "sort": lambda m: torch.sort(m, dim=1, stable=True),
    "sort descending": lambda m: torch.sort(m, dim=0, descending=True, stable=True),
    "sort values": lambda m: torch.sort(m).values,
    "msort": lambda m: torch.msort(m),
    "argsort": lambda m: torch.argsort(m, dim=1, stable=True),
    "topk": lambda m: torch.topk(m, 3, 1).values,
    "topk smallest": lambda m: torch.topk(m, 2, 0, largest=False).values,
    # (which of equal elements topk returns is unspecified, on CPU too: its
    # indices must point at its values)
    "topk of a vector": lambda m: (lambda r: (r.values, m.reshape(-1)[r.indices]))(torch.topk(m.reshape(-1), 5)),
}


def _same(got, expected):
    """Equal, NaNs where CPU's, signs of zeros as CPU's."""
    if isinstance(expected, (tuple, list)):
        return all(_same(g, e) for g, e in zip(got, expected))
    got = got.cpu()
    if got.dtype != expected.dtype or got.shape != expected.shape:
        return False
    if not expected.dtype.is_floating_point:
        return torch.equal(got, expected)
    numbers = ~torch.isnan(expected)
    return (torch.equal(torch.isnan(got), ~numbers) and torch.equal(got[numbers], expected[numbers])
            and torch.equal(torch.signbit(got[numbers]), torch.signbit(expected[numbers])))


@pytest.mark.parametrize("name", sorted(_ELEMENTWISE))
def test_elementwise_keep_nans_as_cpu(name):
    fn = _ELEMENTWISE[name]
    x, y = _values()
    xd, yd = x.to("neuron"), y.to("neuron")
    got, expected = fn(xd, yd), fn(x, y)
    assert _same(xd, x) and _same(yd, y), "an argument changed"
    assert _same(got, expected), f"{got.cpu().tolist()} vs CPU {expected.tolist()}"
    for dtype in (torch.float16, torch.bfloat16):
        got, expected = fn(x.to(dtype).to("neuron"), y.to(dtype).to("neuron")), fn(x.to(dtype), y.to(dtype))
        assert _same(got, expected), (dtype, got.cpu().tolist(), expected.tolist())


@pytest.mark.parametrize("name", sorted(_REDUCTIONS))
def test_reductions_and_orderings_take_nans_as_cpu(name):
    fn = _REDUCTIONS[name]
    m = _rows()
    device = m.to("neuron")
    got, expected = fn(device), fn(m)
    assert torch.equal(device.cpu().nan_to_num(7.0), m.nan_to_num(7.0)), "the input changed"
    assert _same(got, expected), f"{got} vs CPU {expected}"
    half = m.to(torch.bfloat16)
    assert _same(fn(half.to("neuron")), fn(half))


@pytest.mark.op_mode
def test_rules_compile_in_every_float_dtype():
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        before = dict(dispatch_stats.host_fallback)
        m = _rows().to(dtype)
        x, y = (t.to(dtype) for t in _values())
        for fn in _ELEMENTWISE.values():
            assert _same(fn(x.to("neuron"), y.to("neuron")), fn(x, y))
        for fn in _REDUCTIONS.values():
            assert _same(fn(m.to("neuron")), fn(m))
        assert dict(dispatch_stats.host_fallback) == before, (dtype, dispatch_stats.host_fallback)


def test_random_values_without_nans_as_cpu():
    gen = torch.Generator().manual_seed(0)
    # ties, to check which index wins (+ 0.0: no -0.0, which a sort that is not
    # stable may place before or after 0.0)
    m = torch.randn(64, 300, generator=gen).round(decimals=1) + 0.0
    for fn in _REDUCTIONS.values():
        assert _same(fn(m.to("neuron")), fn(m))
    x, y = torch.randn(2, 1000, generator=gen)
    for fn in _ELEMENTWISE.values():
        assert _same(fn(x.to("neuron"), y.to("neuron")), fn(x, y))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.int16, torch.int8])
def test_integer_negation_is_exact(dtype):
    info = torch.iinfo(dtype)
    x = torch.tensor([info.max, info.min + 1, 16777217 % info.max, -(16777219 % info.max), 3, -3, 0], dtype=dtype)
    if dtype == torch.int64:
        x = torch.cat([x, torch.tensor([2**53 + 1, -(2**62 + 5), 12345678901234567])])
    assert torch.equal((-x.to("neuron")).cpu(), -x)
    assert torch.equal(torch.neg(x.to("neuron")).cpu(), torch.neg(x))


def test_pow_by_an_integer_exponent_tensor_as_cpu():
    x, _ = _values()
    for e in (torch.tensor(2), torch.tensor(3), torch.tensor([2, 3] * 6)):
        got, expected = torch.pow(x.to("neuron"), e.to("neuron")), torch.pow(x, e)
        assert _same(got, expected), (e, got.cpu().tolist(), expected.tolist())
