"""float32 elementary functions are as close to exact as CPU's
(lowering/rules/trigonometry.py, hyperbolic.py, double_evaluation.py).

IREE's own float32 expansions were inaccurate where the result is small or
the formula cancels: sin of small x 4.3e-3 off relatively, 1-11 near the
zeros of sin and cos for |x| < 10, up to 1e4 for |x| < 1e5, tan inf near its
poles; asinh(-1e4) was -inf, asinh(1e-6) 4.6% off, atanh(1e-6) 1.3%,
sinh(1e-6) 1.7%; atan and atan2 4.1e-6, pow 3.1e-6, asin 5.3e-7, lgamma
9e-2 near its zeros, erfinv 1.8e-5, erfc 4e-6, exp2 4.1e-6, selu 1.1e-4,
elu 1.7e-5, acosh 6.3e-7 (CPU 6-9e-8). Each case compares neuron's and CPU's largest relative
distance from the float64 answer."""

import math

import pytest
import torch

import torchneuron  # noqa: F401
from torchneuron.dispatch import stats as dispatch_stats

_FUNCTIONS = {"sin": torch.sin, "cos": torch.cos, "tan": torch.tan,
              "sinh": torch.sinh, "asinh": torch.asinh, "atanh": torch.atanh,
              "atan": torch.atan, "asin": torch.asin, "acosh": torch.acosh, "exp2": torch.exp2,
              "erfc": torch.erfc, "erfinv": torch.erfinv, "lgamma": torch.lgamma,
              "elu": torch.nn.functional.elu, "selu": torch.nn.functional.selu, "celu": torch.nn.functional.celu}
_RANGES = {  # (limit of |x|, ...) each function is judged over
    "sin": (1.0, 100.0, 1e5), "cos": (1.0, 100.0, 1e5), "tan": (1.0, 100.0, 1e5),
    "sinh": (1e-3, 1.0, 88.0), "asinh": (1e-3, 10.0, 1e20), "atanh": (1e-3, 0.5, 0.9999),
    "atan": (1e-3, 10.0, 1e20), "asin": (1e-3, 0.5, 1.0), "acosh": (2.0, 100.0, 1e20),
    # (exp2 and erfc stop short of float32 denormals, which compiled ops flush to zero)
    "exp2": (1.0, 30.0, 120.0), "erfc": (0.5, 4.0, 9.0), "erfinv": (0.5, 0.999, 1.0),
    "lgamma": (3.0, 100.0, 1e30), "elu": (1e-3, 1.0, 20.0), "selu": (1e-3, 1.0, 20.0), "celu": (1e-3, 1.0, 20.0),
}
# Arguments inside the domain for the compile check (acosh is nan below 1).
_INSIDE = {"acosh": lambda x: x.abs() + 1.0}


def _arguments(limit: float) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    x = (torch.rand(1 << 16, generator=gen) * 2 - 1) * limit
    if limit > 1e6:  # spread over the magnitudes, not only the largest
        x = torch.sign(x) * torch.exp(torch.rand(1 << 16, generator=gen) * math.log(limit))
    # Near the zeros and poles of the trigonometric functions: the float32 values closest to multiples of pi/2.
    near = torch.tensor([k * math.pi / 2 for k in range(-64, 65)], dtype=torch.float32)
    tiny = torch.tensor([1e-6, -3e-5, 1e-3, 0.7853981], dtype=torch.float32)
    return torch.cat([x, near[near.abs() <= limit], tiny[tiny.abs() <= limit]])


@pytest.mark.parametrize("name,limit", [(n, limit) for n in sorted(_FUNCTIONS) for limit in _RANGES[n]])
def test_float32_results_are_as_close_to_exact_as_cpus(name, limit):
    fn = _FUNCTIONS[name]
    x = _arguments(limit)
    before = x.clone()
    got = fn(x.to("neuron")).cpu()
    assert torch.equal(x, before) and got.dtype == torch.float32
    exact = fn(x.double())
    finite = torch.isfinite(exact) & (exact != 0)
    assert torch.equal(torch.isfinite(got), torch.isfinite(fn(x))), "inf or nan where CPU has none"

    def relative(result):
        return ((result.double() - exact).abs() / exact.abs())[finite].max().item()

    device, cpu = relative(got), relative(fn(x))
    assert device <= 4 * cpu, f"neuron {device:.2e} vs CPU {cpu:.2e} from float64"


@pytest.mark.op_mode
@pytest.mark.parametrize("name", sorted(_FUNCTIONS))
def test_every_float_dtype_compiles(name):
    # The rules return NotImplemented for other dtypes; a rule that failed to trace
    # would leave the op on the host fallback, right but not compiled.
    fn = _FUNCTIONS[name]
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        before = dict(dispatch_stats.host_fallback)
        x = _INSIDE.get(name, lambda x: x)(torch.rand(3, 5) * 1.6 - 0.8).to(dtype)
        torch.testing.assert_close(fn(x.to("neuron")).cpu(), fn(x), rtol=1.6e-2, atol=1e-3)
        assert dict(dispatch_stats.host_fallback) == before, (dtype, dispatch_stats.host_fallback)


@pytest.mark.parametrize("name", sorted(_FUNCTIONS))
def test_non_finite_arguments_signed_zero_and_half_precision_as_cpu(name):
    fn = _FUNCTIONS[name]
    x = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, 0.25, -0.75, 2.5, -1000.25, 1.0, -1.0])
    got, expected = fn(x.to("neuron")).cpu(), fn(x)
    torch.testing.assert_close(got, expected, equal_nan=True, rtol=1e-6, atol=1e-7)
    numbers = ~torch.isnan(expected)  # (a nan's sign means nothing)
    assert torch.equal(torch.signbit(got)[numbers], torch.signbit(expected)[numbers]), "a sign as CPU's"
    zero = torch.tensor([-0.0])  # odd functions keep the sign of zero
    at_zero = fn(zero)
    if not torch.isnan(at_zero).item():
        assert torch.equal(torch.signbit(fn(zero.to("neuron")).cpu()), torch.signbit(at_zero))
    for dtype in (torch.float16, torch.bfloat16):
        h = (torch.linspace(-0.99, 0.99, 999) * _RANGES[name][1]).to(dtype)
        torch.testing.assert_close(fn(h.to("neuron")).cpu(), fn(h), rtol=1.6e-2, atol=1e-3, equal_nan=True)


def test_gradients_as_cpu():
    x = torch.linspace(-20, 20, 401)
    grads = []
    for device in ("cpu", "neuron"):
        leaf = x.clone().to(device).requires_grad_()
        y = torch.sin(leaf) * torch.cos(leaf) + torch.tan(leaf / 7) + torch.asinh(leaf) + torch.sinh(leaf / 10) \
            + torch.atanh(leaf / 21) + torch.atan(leaf) + torch.asin(leaf / 21) \
            + torch.atan2(leaf, leaf.flip(0) + 0.5) \
            + (leaf.abs() + 1) ** (leaf / 40) \
            + torch.erfc(leaf / 5) + torch.acosh(leaf.abs() + 1.5) + torch.exp2(leaf / 4) \
            + torch.erfinv(leaf / 21) + torch.nn.functional.elu(leaf) + torch.nn.functional.selu(leaf / 3)
        y.sum().backward()
        grads.append(leaf.grad.cpu())
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-5)


def _closest(got, fn, *args):
    """(neuron's, CPU's) largest relative distance from the float64 answer."""
    exact = fn(*(a.double() for a in args))
    finite = torch.isfinite(exact) & (exact != 0)

    def relative(result):
        return ((result.double() - exact).abs() / exact.abs())[finite].max().item()

    return relative(got), relative(fn(*args))


def test_atan2_as_close_to_exact_as_cpus_and_its_special_values_as_cpu():
    gen = torch.Generator().manual_seed(1)
    y = torch.randn(1 << 16, generator=gen) * torch.exp(torch.randn(1 << 16, generator=gen) * 4)
    x = torch.randn(1 << 16, generator=gen) * torch.exp(torch.randn(1 << 16, generator=gen) * 4)
    got = torch.atan2(y.to("neuron"), x.to("neuron")).cpu()
    device, cpu = _closest(got, torch.atan2, y, x)
    assert device <= 2 * cpu, f"neuron {device:.2e} vs CPU {cpu:.2e} from float64"
    # Every pair of special values: signed zeros, infinities, nan, ordinary numbers.
    values = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1.5, -2.0, 1e-30])
    ys, xs = values.repeat_interleave(len(values)), values.repeat(len(values))
    got, expected = torch.atan2(ys.to("neuron"), xs.to("neuron")).cpu(), torch.atan2(ys, xs)
    torch.testing.assert_close(got, expected, equal_nan=True, rtol=1e-7, atol=0)
    numbers = ~torch.isnan(expected)  # (a nan's sign means nothing)
    signs = torch.signbit(got)[numbers], torch.signbit(expected)[numbers]
    assert torch.equal(*signs), "a zero or pi with the wrong sign"


def test_pow_as_close_to_exact_as_cpus():
    gen = torch.Generator().manual_seed(2)
    base = torch.rand(1 << 16, generator=gen) * 20 + 1e-3
    exponent = torch.randn(1 << 16, generator=gen) * 4
    cases = [
        (lambda b, e: torch.pow(b, e), base, exponent),
        (lambda b: torch.pow(b, -1.5), base),
        (lambda b: torch.pow(b, 0.37), base),
    ]
    for fn, *args in cases:
        got = fn(*(a.to("neuron") for a in args)).cpu()
        device, cpu = _closest(got, fn, *args)
        assert device <= 2 * cpu, f"neuron {device:.2e} vs CPU {cpu:.2e} from float64"
    # Every pair of special bases and exponents (negative bases with integer
    # exponents were nan), as CPU, signs of zeros and infinities included.
    values = torch.tensor([-2.0, -0.5, 0.0, -0.0, float("inf"), float("-inf"), 3.0, float("nan"), 1.0, -1.0,
                           2.0, -3.0, 0.5, -2.5])
    b, e = values.repeat_interleave(len(values)), values.repeat(len(values))
    got, expected = torch.pow(b.to("neuron"), e.to("neuron")).cpu(), torch.pow(b, e)
    torch.testing.assert_close(got, expected, equal_nan=True, rtol=1e-6, atol=0)
    numbers = ~torch.isnan(expected)
    assert torch.equal(torch.signbit(got)[numbers], torch.signbit(expected)[numbers])
    # The same bases by number exponents (0 ** -1 was -inf).
    for exponent in (2, 3, -1, -2, 5, 0.5, -0.5, -2.5, 0.37, 0, 1, float("inf"), float("-inf"), float("nan")):
        got, expected = torch.pow(values.to("neuron"), exponent).cpu(), torch.pow(values, exponent)
        torch.testing.assert_close(got, expected, equal_nan=True, rtol=1e-6, atol=0)
        numbers = ~torch.isnan(expected)
        assert torch.equal(torch.signbit(got)[numbers], torch.signbit(expected)[numbers]), exponent


@pytest.mark.op_mode
def test_atan2_and_pow_compile_in_every_float_dtype():
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        before = dict(dispatch_stats.host_fallback)
        y, x = (torch.rand(3, 5) * 4 - 2).to(dtype), (torch.rand(3, 5) * 4 - 2).to(dtype)
        p = (torch.rand(3, 5) + 0.1).to(dtype)
        for fn, args in ((torch.atan2, (y, x)), (torch.pow, (p, x)), (lambda a: a ** 1.5, (p,))):
            got = fn(*(a.to("neuron") for a in args)).cpu()
            torch.testing.assert_close(got, fn(*args), rtol=1.6e-2, atol=1e-3)
        assert dict(dispatch_stats.host_fallback) == before, (dtype, dispatch_stats.host_fallback)
