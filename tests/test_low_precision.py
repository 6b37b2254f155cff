"""float16 and bfloat16 ops that must round where PyTorch's CPU kernels do
(issue 14, item 7): scans, vector norms, layer and group norms and
var/var_mean accumulate in float32, batch norm and bfloat16 log_softmax round
their statistics where CPU does, GELU's tanh form takes PyTorch's constants,
and sort/topk may order ties as any sort may. Each is compared with CPU,
compiled (no host fallback), its inputs untouched."""

import math

import pytest
import torch
from torch.testing._internal.common_methods_invocations import SampleInput

import torchneuron
from torchneuron.dispatch import stats
from torchneuron.eval import conformance
from torchneuron.lowering.decompositions import _rounded_to

LOW = [torch.bfloat16, torch.float16]


def _name(dtype):
    return str(dtype).replace("torch.", "")


pytestmark = pytest.mark.op_mode


def _ramp(shape, dtype, scale=1.0):
    """Deterministic values in [-scale, scale], many of them not representable sums."""
    n = math.prod(shape)
    return (torch.sin(torch.arange(n, dtype=torch.float64) * 0.7) * scale).reshape(shape).to(dtype)


def _on_both(fn, *args):
    """fn on CPU and on neuron; the neuron arguments must be unchanged."""
    dev = [a.to("neuron") for a in args]
    before = [a.clone() for a in args]
    torchneuron.reset_stats()
    got = fn(*dev)
    torch.neuron.synchronize()
    for a, b in zip(dev, before):
        assert torch.equal(a.cpu(), b), "an input changed"
    return fn(*args), got


def _no_fallback(*names):
    for name in names:
        assert stats.host_fallback[name] == 0, stats.fallback_reasons


@pytest.mark.parametrize("dtype", LOW, ids=_name)
@pytest.mark.parametrize("op", ["cumsum", "cumprod"])
def test_scans_accumulate_in_float32_as_cpu(op, dtype):
    x = _ramp((6, 40), dtype) + (1.0 if op == "cumprod" else 0.0)
    for dim in (0, 1):
        want, got = _on_both(lambda t, dim=dim: getattr(torch, op)(t, dim), x)
        torch.testing.assert_close(got.cpu(), want)
        _no_fallback(f"aten.{op}.default")


@pytest.mark.parametrize("dtype", LOW, ids=_name)
def test_cumsum_into_a_low_precision_dtype_and_in_place(dtype):
    x = _ramp((64,), torch.float32)
    want, got = _on_both(lambda t: torch.cumsum(t, 0, dtype=dtype), x)
    assert got.dtype == dtype
    torch.testing.assert_close(got.cpu(), want)
    y = _ramp((64,), dtype)
    cpu, dev = y.clone(), y.to("neuron")
    cpu.cumsum_(0)
    dev.cumsum_(0)
    torch.testing.assert_close(dev.cpu(), cpu)


@pytest.mark.parametrize("dtype", LOW, ids=_name)
@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_normalizes_in_float32_as_cpu(dtype, affine):
    x = _ramp((4, 3, 24), dtype, scale=8.0)
    params = (_ramp((24,), dtype, 2.0), _ramp((24,), dtype, 0.5) + 0.25) if affine else ()
    want, got = _on_both(lambda t, *p: torch.nn.functional.layer_norm(t, (24,), *p, eps=1e-5), x, *params)
    torch.testing.assert_close(got.cpu(), want)
    _no_fallback("aten.native_layer_norm.default")
    # The statistics hold CPU's values in CPU's dtype (the input's; the meta
    # kernel says float32, CUDA's choice, but the host path gives CPU's).
    want, got = _on_both(lambda t: torch.native_layer_norm(t, [24], None, None, 1e-5), x)
    for w, g in zip(want, got):
        torch.testing.assert_close(g.cpu(), w)


_A = torch.ops.aten
_NORMALIZATIONS = {  # name -> fn(x, weight, bias, running mean, running var)
    "native_layer_norm": lambda x, w, b, m, v: _A.native_layer_norm(x, [6], w, b, 1e-5),
    "native_group_norm": lambda x, w, b, m, v: _A.native_group_norm(x, w, b, 4, 6, 6, 2, 1e-5),
    "native_batch_norm": lambda x, w, b, m, v: _A.native_batch_norm(x, w, b, m, v, True, 0.1, 1e-5),
    "_native_batch_norm_legit": lambda x, w, b, m, v: _A._native_batch_norm_legit(x, w, b, m, v, True, 0.1, 1e-5),
    "_native_batch_norm_legit.no_stats": lambda x, w, b, m, v: _A._native_batch_norm_legit.no_stats(x, w, b, True,
                                                                                                   0.1, 1e-5),
    "_batch_norm_with_update": lambda x, w, b, m, v: _A._batch_norm_with_update(x, w, b, m, v, 0.1, 1e-5),
}


@pytest.mark.parametrize("params", [None, torch.float32], ids=["same", "float32-params"])
@pytest.mark.parametrize("dtype", LOW, ids=_name)
@pytest.mark.parametrize("name", sorted(_NORMALIZATIONS))
def test_normalization_statistics_have_cpus_dtype_and_values(name, dtype, params):
    # CPU keeps a half-precision input's statistics in its dtype, float32 when
    # a parameter is float32 ("mixed"); the values are CPU's float32 moments,
    # rounded only where CPU rounds them.
    fn = _NORMALIZATIONS[name]
    p = params or dtype
    x = _ramp((4, 6, 6), dtype, scale=3.0)
    w, b = _ramp((6,), p, 0.5) + 1.0, _ramp((6,), p, 0.5)
    mean, var = _ramp((6,), p, 0.3), _ramp((6,), p, 0.2) + 1.0
    with_running = "batch" in name and "no_stats" not in name
    want, got = _on_both(lambda x, w, b: fn(x, w, b, None, None), x, w, b) if not with_running else (None, None)
    if want is None:  # the running statistics are updated in place, as CPU's
        want = fn(x, w, b, mean_c := mean.clone(), var_c := var.clone())
        got = fn(x.to("neuron"), w.to("neuron"), b.to("neuron"), mean_n := mean.to("neuron"), var_n := var.to("neuron"))
        torch.testing.assert_close(mean_n.cpu(), mean_c)
        torch.testing.assert_close(var_n.cpu(), var_c)
    for i, (c, n) in enumerate(zip(want[:3], got[:3])):
        assert n.dtype == c.dtype, (i, n.dtype, c.dtype)
        # float32 statistics of a mixed call are not rounded to the input's type
        tolerance = {"rtol": 1e-5, "atol": 1e-6} if c.dtype == torch.float32 else {}
        torch.testing.assert_close(n.cpu(), c, **tolerance)
    _no_fallback(f"aten.{name}" + ("" if "." in name else ".default"))


def test_statistics_dtype_is_the_same_while_compiling_and_compiled():
    # The first call runs on the host while it compiles; it and the compiled
    # calls after it must agree on the results' dtypes.
    torchneuron.config.set(compile_wait=False)
    x = _ramp((3, 10), torch.float16).to("neuron")
    dtypes = []
    for _ in range(3):
        dtypes.append([t.dtype for t in torch.native_layer_norm(x, [10], None, None, 1e-4)])
        torchneuron.wait_for_compiles()
    assert dtypes == [[torch.float16] * 3] * 3


@pytest.mark.parametrize("dtype", LOW, ids=_name)
def test_group_norm_normalizes_in_float32_as_cpu(dtype):
    x = _ramp((2, 6, 5), dtype, scale=8.0)
    w, b = _ramp((6,), dtype, 2.0), _ramp((6,), dtype, 0.5)
    want, got = _on_both(lambda t, w, b: torch.nn.functional.group_norm(t, 3, w, b), x, w, b)
    torch.testing.assert_close(got.cpu(), want)
    _no_fallback("aten.native_group_norm.default")


@pytest.mark.parametrize("dtype", LOW, ids=_name)
@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_rounds_its_statistics_as_cpu(dtype, training):
    # CPU stores the batch mean and 1/std in the input's type before normalizing.
    x = _ramp((5, 4, 6), dtype, scale=3.0)
    w, b = _ramp((4,), dtype, 2.0), _ramp((4,), dtype, 0.5)
    stats_cpu = [_ramp((4,), dtype, 0.3), _ramp((4,), dtype, 0.2) + 1.0]
    stats_dev = [t.to("neuron") for t in stats_cpu]
    torchneuron.reset_stats()
    got = torch.nn.functional.batch_norm(x.to("neuron"), *stats_dev, w.to("neuron"), b.to("neuron"), training)
    want = torch.nn.functional.batch_norm(x, *stats_cpu, w, b, training)
    torch.testing.assert_close(got.cpu(), want)
    for d, c in zip(stats_dev, stats_cpu):  # running statistics updated as CPU's
        torch.testing.assert_close(d.cpu(), c)
    _no_fallback("aten.native_batch_norm.default")


@pytest.mark.parametrize("dtype", LOW, ids=_name)
def test_var_and_var_mean_accumulate_in_float32_as_cpu(dtype):
    x = _ramp((5, 9, 4), dtype, scale=8.0)
    want, got = _on_both(lambda t: torch.var_mean(t, dim=1), x)
    for w, g in zip(want, got):
        torch.testing.assert_close(g.cpu(), w)
    want, got = _on_both(lambda t: torch.var(t, dim=(0, 2), correction=0), x)
    torch.testing.assert_close(got.cpu(), want)
    _no_fallback("aten.var_mean.correction", "aten.var.correction")


@pytest.mark.parametrize("dtype", LOW, ids=_name)
def test_vector_norm_accumulates_in_float32_as_cpu(dtype):
    # float16's squares sum past its largest value (65504): CPU's norm is finite.
    x = torch.full((1000,), 20.0, dtype=dtype) + _ramp((1000,), dtype)
    for fn in (lambda t: torch.linalg.vector_norm(t), lambda t: torch.dist(t, -t), lambda t: t.norm(3)):
        want, got = _on_both(fn, x)
        assert torch.isfinite(got.cpu()).all()
        torch.testing.assert_close(got.cpu(), want)
    _no_fallback("aten.linalg_vector_norm.default")


@pytest.mark.parametrize("dtype", LOW, ids=_name)
def test_log_softmax_matches_cpu(dtype):
    # Over the last dimension CPU stores sum(exp(x - max)) and its log in the
    # input's type: in bfloat16 the first row's sum (1.0037) rounds to 1, so its
    # maximum maps to exactly 0, as neuron's (float32 throughout: -0.0038).
    # float16 computes in float32 and rounds once (CPU: 2e-4 off that).
    x = torch.tensor([[0.0, -6.0, -7.0, -8.0, -9.0], [1.0, 2.0, 3.0, 4.0, 5.0]], dtype=dtype)
    want, got = _on_both(lambda t: torch.log_softmax(t, -1), x)
    if dtype == torch.bfloat16:
        assert torch.equal(got.cpu(), want)
        assert got[0, 0].item() == 0.0
    else:
        assert torch.equal(got.cpu(), torch.log_softmax(x.float(), -1).to(dtype))
        torch.testing.assert_close(got.cpu(), want, rtol=1e-3, atol=1e-3)  # PyTorch's device-vs-CPU test
    _no_fallback("aten._log_softmax.default")
    # Other dimensions compute in float32 and round once, as CPU's kernel.
    y = _ramp((5, 7, 3), dtype, scale=4.0)
    for dim in (0, 1, 2):
        want, got = _on_both(lambda t, dim=dim: torch.log_softmax(t, dim), y)
        torch.testing.assert_close(got.cpu(), want, **({} if dim < 2 or dtype == torch.bfloat16 else
                                                         {"rtol": 1e-3, "atol": 1e-3}))


@pytest.mark.parametrize("dtype", [*LOW, torch.float32], ids=_name)
@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_gelu_matches_cpu(dtype, approximate):
    x = torch.linspace(-6, 4, 1001).to(dtype)
    want, got = _on_both(lambda t: torch.nn.functional.gelu(t, approximate=approximate), x)
    # float32: within the device's tanh and erf (torch-mlir's own tanh form was
    # 5e-5 off); float16/bfloat16: computed in float32 and rounded once.
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {}
    torch.testing.assert_close(got.cpu(), want, **tol)
    _no_fallback("aten.gelu.default")


@pytest.mark.parametrize("dtype", LOW, ids=_name)
def test_sort_and_topk_give_cpus_values_and_valid_indices(dtype):
    # Distinct integers that float16/bfloat16 round into runs of equal values.
    x = torch.randperm(3000, generator=torch.Generator().manual_seed(0)).to(dtype)
    want, got = _on_both(lambda t: torch.sort(t), x)
    assert torch.equal(got.values.cpu(), want.values)
    assert torch.equal(x[got.indices.cpu()], want.values)
    assert torch.equal(got.indices.cpu().sort().values, torch.arange(3000))
    # Asked for a stable sort, the order of ties is CPU's exactly.
    want, got = _on_both(lambda t: torch.sort(t, stable=True, descending=True), x)
    assert torch.equal(got.values.cpu(), want.values) and torch.equal(got.indices.cpu(), want.indices)
    m = _ramp((5, 40), dtype, scale=9.0).round()
    want, got = _on_both(lambda t: torch.topk(t, 6, dim=1), m)
    assert torch.equal(got.values.cpu(), want.values)
    assert torch.equal(m.gather(1, got.indices.cpu()), want.values)
    assert all(len(set(row.tolist())) == 6 for row in got.indices.cpu())


def test_bfloat16_rounding_on_the_bits_is_round_to_nearest_even():
    x = torch.randn(20000) * torch.pow(10.0, torch.randint(-40, 38, (20000,)).float())
    x = torch.cat([x, torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0, 3.3895314e38, 1e-45, 1.00390625])])
    want = x.to(torch.bfloat16).float()
    got = _rounded_to(x, torch.bfloat16)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~got.isnan()], want[~want.isnan()])


def test_conformance_accepts_only_a_different_order_of_ties():
    sort = next(o for o in conformance._op_db() if o.name == "sort")
    x = torch.tensor([2.0, 1.0, 2.0, 1.0])
    sample = SampleInput(x)
    expected = torch.sort(x)  # values [1, 1, 2, 2]
    ties = torch.return_types.sort((expected.values, torch.tensor([3, 1, 2, 0])))
    assert conformance._with_ties_as_cpu(sort, sample, ties, expected) is not ties
    for wrong in ([1, 1, 0, 2], [3, 1, 2, 2], [0, 1, 2, 3], [1, 3, 0, 9]):
        candidate = torch.return_types.sort((expected.values, torch.tensor(wrong)))
        assert conformance._with_ties_as_cpu(sort, sample, candidate, expected) is candidate
    stable = SampleInput(x, stable=True)
    assert conformance._with_ties_as_cpu(sort, stable, ties, expected) is ties


def test_conformance_takes_any_index_of_an_equal_element_for_kthvalue_and_median():
    """PyTorch documents which of equal elements kthvalue and median index as
    device-specific; an index of another element with CPU's value passes,
    one of an element with another value does not."""
    x = torch.tensor([[2.0, 1.0, 2.0, 2.0, 0.0], [5.0, 3.0, 1.0, 3.0, 0.0]])
    for name, sample, fn in (("kthvalue", SampleInput(x, 3, 1), lambda: torch.kthvalue(x, 3, 1)),
                             ("median", SampleInput(x, 1), lambda: torch.median(x, 1))):
        opinfo = next(o for o in conformance._op_db() if o.name == name)
        expected = fn()
        other = expected.indices.clone()
        other[0] = next(i for i in (0, 2, 3) if i != other[0])  # another 2
        candidate = type(expected)((expected.values, other))
        assert conformance._with_ties_as_cpu(opinfo, sample, candidate, expected) is not candidate
        wrong = type(expected)((expected.values, torch.tensor([1, expected.indices[1].item()])))
        assert conformance._with_ties_as_cpu(opinfo, sample, wrong, expected) is wrong
