"""cummax, cummin, kthvalue and median compiled, with CPU's values and
indices: ties, NaN, signed zeros (lowering/rules/order_statistics.py)."""

import math

import pytest
import torch


NAN = math.nan


def _same(fn, x):
    """fn's results on neuron and on CPU: values bit for bit (NaN where CPU
    has NaN), indices equal."""
    want, got = fn(x), fn(x.neuron())
    for w, g in zip(want, got):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g.cpu(), w, equal_nan=True, rtol=0, atol=0)


_ROWS = torch.tensor([[1.0, 3.0, 3.0, NAN, 5.0, NAN, -0.0, 0.0],
                      [0.0, -0.0, 0.0, 2.0, 2.0, -1.0, -1.0, 4.0],
                      [NAN, 1.0, NAN, 0.0, 7.0, 7.0, -3.0, -3.0]])


@pytest.mark.compile_wait
@pytest.mark.parametrize("op", [torch.cummax, torch.cummin], ids=["cummax", "cummin"])
def test_running_extremes_give_cpus_values_and_indices(op, compiled_only):
    """The latest of equal values; a NaN wins and the index moves to each later NaN."""
    _same(lambda t: op(t, 1), _ROWS)
    _same(lambda t: op(t, 0), _ROWS)
    torch.manual_seed(0)
    long = torch.randint(0, 5, (3, 1000)).float()
    _same(lambda t: op(t, 1), long)
    for dtype in (torch.int64, torch.int32, torch.uint8, torch.bool):
        values = torch.randint(0, 256, (4, 37)).to(dtype)
        _same(lambda t: op(t, 1), values)
        _same(lambda t: op(t, 0), values)


def _valid_tie_indices(fn, x, dim):
    """Values equal to CPU's; each index points at an element equal to its
    value (PyTorch documents the index among equal values as device-specific:
    CPU's is where its quickselect stopped; here it is the first)."""
    want, got = fn(x), fn(x.neuron())
    torch.testing.assert_close(got[0].cpu(), want[0], equal_nan=True, rtol=0, atol=0)
    index = got[1].cpu()
    picked = x.gather(dim, index if index.dim() == x.dim() else index.unsqueeze(dim))
    picked = picked if index.dim() == x.dim() else picked.squeeze(dim)
    torch.testing.assert_close(picked, want[0], equal_nan=True, rtol=0, atol=0)


@pytest.mark.compile_wait
def test_kthvalue_and_median_give_cpus_values_and_indices(compiled_only):
    torch.manual_seed(0)
    distinct = torch.randn(5, 9)
    distinct[1, 3] = distinct[3, 2] = NAN  # (two NaNs in a row are ties: see below)
    for k in (1, 4, 9):
        _same(lambda t: torch.kthvalue(t, k, 1), distinct)
    _same(lambda t: torch.kthvalue(t, 2, 0, keepdim=True), distinct)
    _same(lambda t: torch.median(t, 1), distinct)  # a row with NaN: NaN and the first NaN's index
    _same(lambda t: torch.median(t, 0, keepdim=True), distinct)
    _same(lambda t: (torch.median(t),), distinct)
    _same(lambda t: (torch.median(t),), distinct[0])
    _same(lambda t: torch.median(t, 1), torch.randperm(45).reshape(5, 9).to(torch.uint8) * 5)
    _same(lambda t: torch.kthvalue(t, 4, 1), torch.randperm(45).reshape(5, 9) - 20)
    ties = torch.tensor([[2.0, 1.0, 2.0, 2.0, 0.0, 2.0], [5.0, NAN, 1.0, NAN, 0.0, 3.0]])
    for k in range(1, 7):
        _valid_tie_indices(lambda t: torch.kthvalue(t, k, 1), ties, 1)
    _valid_tie_indices(lambda t: torch.median(t, 1), ties, 1)
