"""Ops torch-mlir does not lower compile through torchneuron's own
decompositions, and all-0-dim calls the compiler rejects compile as
1-element calls (issue: compile-first eager mode)."""

import math

import pytest
import torch
import torch.nn.functional as F

import torchneuron

torch.manual_seed(0)
_X = torch.randn(3, 4, 5)
_X[0, 0, 0] = math.nan
_Y = torch.randn(4, 5)
_Y[1, 1] = math.nan
_Z = torch.randn(3, 6, 5)

CASES = {
    "roll": lambda x, y, z: torch.roll(x, (1, -2), (0, 2)),
    "roll_flat": lambda x, y, z: torch.roll(x, 7),
    "fmax_nan": lambda x, y, z: torch.fmax(x, y),
    "fmin_scalar_tensor": lambda x, y, z: torch.fmin(x, y[0, 0]),
    "hypot": lambda x, y, z: torch.hypot(x, y),
    "angle": lambda x, y, z: torch.angle(x),
    "cdist_p2": lambda x, y, z: torch.cdist(x.nan_to_num(), z),
    "cdist_p1": lambda x, y, z: torch.cdist(x.nan_to_num(), z, p=1),
    "cdist_pinf": lambda x, y, z: torch.cdist(x.nan_to_num(), z, p=math.inf),
    "nearest_1d_scale": lambda x, y, z: F.interpolate(x, scale_factor=1.7, mode="nearest"),
    "nearest_2d_down": lambda x, y, z: F.interpolate(x.unsqueeze(0), size=(7, 3), mode="nearest"),
    "nearest_exact_1d": lambda x, y, z: F.interpolate(x, size=8, mode="nearest-exact"),
    "eye": lambda x, y, z: torch.eye(4, 6, device=x.device) + x[0, :, :1].nan_to_num(),
    "put_accumulate": lambda x, y, z: torch.put(y, torch.tensor([0, -1, 7, 7], device=y.device),
                                                 x[0, 0, 1:5], accumulate=True),
    "scatter_multiply": lambda x, y, z: y.scatter(0, (z[0, :2].abs() * 2).long().clamp(max=3), z[1, :2],
                                                  reduce="multiply"),
    "index_reduce_amax": lambda x, y, z: z[0].nan_to_num().index_reduce(
        0, torch.tensor([0, 2, 0], device=z.device), x[0, :3].nan_to_num(), "amax", include_self=False),
    "cumprod_dtype": lambda x, y, z: torch.cumprod(z[0, 0], 0, dtype=torch.float32),
    "mm_empty_inner": lambda x, y, z: torch.mm(y[:, :0], z[0, :0, :]),
    "adaptive_max_pool2d_unbatched": lambda x, y, z: F.adaptive_max_pool2d(z, (2, 3)),
    "number_minus_tensor_in_loss": lambda x, y, z: F.multilabel_soft_margin_loss(z[0], (z[1] > 0).float()),
    "logcumsumexp_wide_range": lambda x, y, z: torch.logcumsumexp(z * 300, 1),
    "zeta_number_self": lambda x, y, z: torch.special.zeta(2.0, y.nan_to_num().abs() + 0.5),
    "isin": lambda x, y, z: torch.isin(x.round(), y[2, :3].round()),
    "isin_invert": lambda x, y, z: torch.isin(y.round(), x[1, 1].round(), invert=True),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_decomposed_op_compiles_and_matches_cpu(name):
    fn = CASES[name]
    expected = fn(_X, _Y, _Z)
    torchneuron.reset_stats()
    actual = fn(_X.to("neuron"), _Y.to("neuron"), _Z.to("neuron")).cpu()
    assert torchneuron.fallback_ops() == {}, torchneuron.fallback_ops()
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4, equal_nan=True)


def test_all_0dim_reductions_compile_as_one_element_calls():
    x = torch.tensor(-1.5)
    cases = [
        lambda t: t.amax(),
        lambda t: t.argmax(),
        lambda t: t.all(dim=0),
        lambda t: torch.logsumexp(t, 0),
        lambda t: torch.argmin(t, 0, keepdim=True),
    ]
    torchneuron.reset_stats()
    for fn in cases:
        expected, actual = fn(x), fn(x.to("neuron")).cpu()
        assert (actual.shape, actual.dtype) == (expected.shape, expected.dtype)
        torch.testing.assert_close(actual, expected)
    assert torchneuron.fallback_ops() == {}


def test_a_number_in_the_self_slot_also_runs_on_the_host_fallback():
    # special.zeta(2.0, x) reaches the backend as special_zeta(2.0, x) with a
    # Python number where the op wants a Tensor.
    x = torch.rand(5) + 0.5
    torchneuron.config.set(execution="host")
    try:
        actual = torch.special.zeta(2.0, x.to("neuron")).cpu()
    finally:
        torchneuron.config.set(execution="compile")
    torch.testing.assert_close(actual, torch.special.zeta(2.0, x))


@pytest.mark.parametrize("activation", [F.silu, F.mish], ids=["silu", "mish"])
def test_activation_backward_with_a_composite_kernel_compiles(activation):
    """silu_backward and mish_backward have a CPU kernel and a composite one:
    they reach the backend whole and torch.export keeps them whole."""
    x = torch.randn(3, 7)
    xn = x.to("neuron").requires_grad_()
    before = torchneuron.fallback_ops()
    activation(xn).sum().backward()
    xc = x.clone().requires_grad_()
    activation(xc).sum().backward()
    torch.testing.assert_close(xn.grad.cpu(), xc.grad, rtol=1e-5, atol=1e-6)
    assert torchneuron.fallback_ops() == before


_A = torch.ops.aten


@pytest.mark.parametrize("call", [
    lambda x, w, b, rm, rv: _A.native_batch_norm(x, w, b, rm, rv, False, 0.1, 1e-5),
    lambda x, w, b, rm, rv: _A._native_batch_norm_legit(x, w, b, rm, rv, False, 0.1, 1e-5),
    lambda x, w, b, rm, rv: _A._native_batch_norm_legit_no_training(x, w, b, rm, rv, 0.1, 1e-5),
    lambda x, w, b, rm, rv: _A._batch_norm_no_update(x, w, b, rm, rv, 0.1, 1e-5),
], ids=["native", "legit", "legit_no_training", "no_update"])
def test_batch_norm_in_evaluation_returns_cpus_empty_statistics(call):
    """CPU returns empty saved statistics in evaluation, the meta kernels
    full-size ones: the device gives CPU's (compiled, in a fused graph or on
    the host alike), twice, so adaptive eager records the second call."""
    torch.manual_seed(0)
    args = [torch.randn(2, 8, 3, 3)] + [torch.randn(8) for _ in range(3)] + [torch.rand(8) + 0.5]
    want = call(*[a.clone() for a in args])
    before = torchneuron.fallback_ops()
    for _ in range(2):
        moved = [a.to("neuron") for a in args]
        got = call(*moved)
        assert [tuple(g.shape) for g in got] == [tuple(w.shape) for w in want]
        for g, w in zip(got, want):
            torch.testing.assert_close(g.cpu(), w)
        for m, a in zip(moved, args):
            torch.testing.assert_close(m.cpu(), a, rtol=0, atol=0)
    if torchneuron.get_eager_mode() == "op":
        assert torchneuron.fallback_ops() == before  # compiled


_UPSAMPLINGS = {
    "bilinear_up": ((2, 3, 8, 10), dict(size=(16, 20), mode="bilinear")),
    "bilinear_up_corners": ((2, 3, 8, 10), dict(size=(16, 20), mode="bilinear", align_corners=True)),
    "bilinear_mixed": ((1, 2, 7, 5), dict(size=(3, 11), mode="bilinear")),
    "bilinear_scale_factor": ((1, 2, 7, 5), dict(scale_factor=(1.7, 2.3), mode="bilinear")),
    "bilinear_same_size": ((2, 3, 8, 10), dict(size=(8, 10), mode="bilinear")),
    "linear_corners": ((2, 4, 9), dict(size=20, mode="linear", align_corners=True)),
    "trilinear": ((1, 2, 3, 4, 5), dict(size=(6, 7, 3), mode="trilinear")),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", sorted(_UPSAMPLINGS))
def test_linear_upsampling_backward_compiles_and_matches_cpu(name, dtype):
    """upsample_{linear1d,bilinear2d,trilinear3d}_backward have no decomposition in PyTorch and
    torch-mlir does not lower them: torchneuron's gathers each input's weighted gradients."""
    shape, kwargs = _UPSAMPLINGS[name]
    x = torch.randn(shape, dtype=dtype)
    kwargs.setdefault("align_corners", False)
    grad = torch.randn(F.interpolate(x, **kwargs).shape, dtype=dtype)
    xc = x.clone().requires_grad_()
    F.interpolate(xc, **kwargs).backward(grad)
    xn, grad_n = x.to("neuron").requires_grad_(), grad.to("neuron")
    before = torchneuron.fallback_ops()
    F.interpolate(xn, **kwargs).backward(grad_n)
    assert torchneuron.fallback_ops() == before
    tol = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(xn.grad.cpu(), xc.grad, rtol=tol, atol=tol)
    assert torch.equal(grad_n.cpu(), grad) and torch.equal(xn.detach().cpu(), x)
