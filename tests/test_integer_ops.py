"""Integer and bool tensors compute as CPU's: ops torch-mlir lowers with the
wrong signedness, or not at all, for them (lowering/rules/unsigned_bytes.py,
nan_propagation.py's integer sort, dispatch's bincount)."""

import math
import re

import pytest
import torch



def _integers(dtype, shape):
    if dtype == torch.int64:  # values past 32 bits, many ties
        return torch.randint(-3, 3, shape) * 2**60 + torch.randint(0, 2, shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape).bool()
    return torch.randint(0, 4, shape).to(dtype)


@pytest.mark.compile_wait
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool], ids=str)
def test_stable_sort_of_integers_compiles_and_orders_ties_as_cpu(dtype, compiled_only):
    # (MoE routing sorts its int64 expert ids stably; torch-mlir lowers no sort.stable.)
    torch.manual_seed(0)
    for shape, dim in (((32,), 0), ((5, 40), 1), ((40, 6), 0), ((3, 4, 50), -1)):
        x = _integers(dtype, shape)
        d = x.neuron()
        for descending in (False, True):
            values, indices = torch.sort(d, dim=dim, descending=descending, stable=True)
            want = torch.sort(x, dim=dim, descending=descending, stable=True)
            assert torch.equal(values.cpu(), want.values) and torch.equal(indices.cpu(), want.indices)
            assert torch.equal(torch.argsort(d, dim=dim, descending=descending, stable=True).cpu(), want.indices)
        assert torch.equal(d.cpu(), x)


@pytest.mark.compile_wait
def test_bincount_reads_its_length_and_counts_compiled(compiled_only):
    torch.manual_seed(0)
    cases = [(torch.randint(0, 8, (32,)), None, 0), (torch.randint(0, 8, (32,)), None, 12),
             (torch.randint(0, 50, (1000,)).int(), torch.rand(1000), 0),
             (torch.randint(0, 5, (10,)).to(torch.uint8), torch.rand(10, dtype=torch.float64), 3),
             (torch.randint(0, 5, (10,)), torch.randint(0, 4, (10,)).int(), 0),
             (torch.tensor([], dtype=torch.long), torch.tensor([]), 2)]
    for x, weights, minlength in cases:
        want = torch.bincount(x, weights, minlength=minlength)
        got = torch.bincount(x.neuron(), None if weights is None else weights.neuron(), minlength=minlength)
        assert got.device.type == "neuron" and got.dtype == want.dtype
        torch.testing.assert_close(got.cpu(), want)


@pytest.mark.parametrize("args", [(torch.tensor([-1, 2]), None, 0), (torch.tensor([[1]]), None, 0),
                                  (torch.tensor([1, 2]), torch.ones(3), 0), (torch.tensor([1, 2]), None, -1),
                                  (torch.tensor([1.0]), None, 0)], ids=["negative", "2-d", "weights", "minlength", "float"])
def test_bincount_of_bad_input_raises_cpus_error(args):
    x, weights, minlength = args
    with pytest.raises(Exception) as on_cpu:
        torch.bincount(x, weights, minlength=minlength)
    with pytest.raises(type(on_cpu.value), match=re.escape(str(on_cpu.value))):
        torch.bincount(x.neuron(), None if weights is None else weights.neuron(), minlength=minlength)


@pytest.mark.compile_wait
@pytest.mark.parametrize("dtype", [torch.uint8, torch.bool, torch.int64, torch.float32], ids=str)
def test_whole_tensor_max_and_min_compile(dtype, compiled_only):
    x = _integers(dtype, (4, 5)) if not dtype.is_floating_point else torch.tensor([[1.0, math.nan], [3.0, -2.0]])
    for reduce in (torch.max, torch.min):
        got, want = reduce(x.neuron()).cpu(), reduce(x)
        assert got.dtype == want.dtype and torch.equal(got, want) or (got.isnan() and want.isnan())


_UINT8_OPS = {
    "sort": lambda a, b: torch.sort(a, 1),
    "topk": lambda a, b: torch.topk(a, 3, 1),
    "msort": lambda a, b: a.msort(),
    "clamp to a tensor": lambda a, b: a.clamp(min=b),
    "true division": lambda a, b: a / b,
    "division by a number": lambda a, b: a / 64,
    "floor division (rounding mode)": lambda a, b: torch.div(a, b, rounding_mode="floor"),
    "remainder": lambda a, b: a % b,
    "remainder by a number": lambda a, b: a % 7,
    "fmod": lambda a, b: torch.fmod(a, b),
    "abs": lambda a, b: a.abs(),
    "sum of rows": lambda a, b: a.sum(1),
    "sum": lambda a, b: a.sum(),
    "sum as float32": lambda a, b: a.sum(1, dtype=torch.float32),
    "prod": lambda a, b: a.prod(1),
    "searchsorted": lambda a, b: torch.searchsorted(a.sort(1).values, b),
    "wrapping add": lambda a, b: a + b,
    "comparison": lambda a, b: a < b,
}


@pytest.mark.compile_wait
@pytest.mark.parametrize("name", list(_UINT8_OPS))
def test_uint8_values_above_127_compute_as_cpu(name):
    """torch-mlir read uint8 bytes as signed in these ops (a row of uint8
    summed to 129 where CPU says 1153; 200 sorted before 3)."""
    torch.manual_seed(0)
    a = torch.randint(0, 256, (4, 9)).to(torch.uint8)
    b = torch.randint(1, 256, (4, 9)).to(torch.uint8)
    fn = _UINT8_OPS[name]
    want = fn(a, b)
    got = fn(a.neuron(), b.neuron())
    for w, g in zip(want if isinstance(want, tuple) else (want,), got if isinstance(got, tuple) else (got,)):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g.cpu(), w, rtol=1e-6, atol=0)


@pytest.mark.compile_wait
def test_bools_sort_false_first(compiled_only):
    """torch-mlir compared i1 as signed (True below False)."""
    torch.manual_seed(0)
    x = torch.randint(0, 2, (3, 50)).bool()
    for descending in (False, True):
        got = torch.sort(x.neuron(), 1, descending=descending)
        assert torch.equal(got.values.cpu(), torch.sort(x, 1, descending=descending).values)
        assert torch.equal(torch.argsort(x.neuron(), dim=1, stable=True).cpu(), torch.argsort(x, dim=1, stable=True))


def test_topk_of_bools_raises_cpus_error():
    with pytest.raises(RuntimeError, match="topk does not support bool"):
        torch.topk(torch.ones(3, 5, dtype=torch.bool), 2, 1)
    with pytest.raises(RuntimeError, match="topk does not support bool"):
        torch.topk(torch.ones(3, 5, dtype=torch.bool).neuron(), 2, 1)


@pytest.mark.compile_wait
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.float32], ids=str)
def test_constant_padding_compiles_for_every_dtype_and_value(dtype, compiled_only):
    """Hugging Face pads every causal LM's labels with -100 (F.pad of int64):
    IREE could not convert a runtime pad value to an integer type, so the
    pad value is a constant of the executable; a new value compiles anew."""
    x = _integers(dtype, (4, 6)) if dtype != torch.float32 else torch.randn(4, 6)
    for value in (-100 if dtype != torch.uint8 else 200, 7, 2.5 if dtype == torch.float32 else 3):
        pad = (0, 1, 2, 0)
        got = torch.nn.functional.pad(x.neuron(), pad, value=value)
        want = torch.nn.functional.pad(x, pad, value=value)
        assert got.dtype == want.dtype and torch.equal(got.cpu(), want)
