"""Special functions compile (as elementwise graphs) and match CPU, including
their poles, domains, infinities and NaN (issue: compile-first eager mode)."""

import math

import pytest
import torch

import torchneuron

_GRID = torch.cat([
    torch.linspace(-20, 20, 161),
    torch.tensor([0.0, -0.0, 1e-6, -1e-6, 0.5, 1.0, 2.0, 8.0, 30.0, -2.5, math.inf, -math.inf, math.nan]),
])
_PROB = torch.cat([torch.linspace(0, 1, 41), torch.tensor([-0.1, 1.1, 1e-10, 1 - 1e-7, math.nan])])
_UNIT = torch.linspace(-1, 1, 81)

CASES = {
    "lgamma": (torch.lgamma, _GRID),
    "digamma": (torch.digamma, _GRID),
    "polygamma_2": (lambda t: torch.polygamma(2, t), _GRID + 0.25),
    "zeta": (lambda t: torch.special.zeta(t.abs() + 1.5, t.abs() + 0.1), _GRID),
    "erfc": (torch.erfc, _GRID),
    "erfcx": (torch.special.erfcx, _GRID),
    "log_ndtr": (torch.special.log_ndtr, _GRID),
    "ndtri": (torch.special.ndtri, _PROB),
    "erfinv": (torch.erfinv, _UNIT),
    "i0": (torch.i0, _GRID),
    "i1e": (torch.special.i1e, _GRID),
    "bessel_j1": (torch.special.bessel_j1, _GRID),
    "bessel_y0": (torch.special.bessel_y0, _GRID),
    "modified_bessel_k1": (torch.special.modified_bessel_k1, _GRID),
    "scaled_modified_bessel_k0": (torch.special.scaled_modified_bessel_k0, _GRID),
    "spherical_bessel_j0": (torch.special.spherical_bessel_j0, _GRID),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_special_function_compiles_and_matches_cpu(name):
    fn, grid = CASES[name]
    torchneuron.reset_stats()
    actual = fn(grid.to("neuron")).cpu()
    assert torchneuron.fallback_ops() == {}, torchneuron.fallback_ops()
    torch.testing.assert_close(actual, fn(grid), rtol=1e-4, atol=1e-4, equal_nan=True)


@pytest.mark.compile_wait
def test_half_inputs_compute_in_float32_and_float64_stays_exact_on_host():
    x = torch.linspace(0.1, 5, 32)
    torchneuron.reset_stats()
    half = torch.lgamma(x.half().to("neuron")).cpu()
    assert half.dtype == torch.float16 and torchneuron.fallback_ops() == {}
    torch.testing.assert_close(half, torch.lgamma(x.half()), rtol=2e-3, atol=2e-3)
    # No float64 transcendentals on the CPU target: the host keeps full precision.
    exact = torch.lgamma(x.double().to("neuron")).cpu()
    assert "aten.lgamma.default" in torchneuron.fallback_ops()
    torch.testing.assert_close(exact, torch.lgamma(x.double()), rtol=1e-12, atol=1e-12)
