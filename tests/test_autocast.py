"""torch.autocast("neuron") and torch.amp.GradScaler("neuron") (issue 14,
items 5 and 6): PyTorch's own op lists and cast policies (csrc/autocast.cpp),
GradScaler's unscale and update kernels compiled on the device, and the demo
GPT trained in mixed precision against float32 on CPU."""

import collections
import math

import pytest
import torch
from torch.testing._internal.autocast_test_lists import AutocastTestLists

import torchneuron
from torchneuron.dispatch import stats
from torchneuron.models import GPTConfig, train_gpt

LOW = torch.bfloat16


def _cases():
    """(list name, op, args, kwargs, expected dtype) from the lists PyTorch's
    own CUDA autocast tests use, built on neuron."""
    lists = AutocastTestLists(torch.device("neuron"))
    expect = {
        "torch_fp16": LOW, "nn_fp16": LOW, "linalg_fp16": LOW, "methods_fp16": LOW,
        "torch_fp32": torch.float32, "nn_fp32": torch.float32, "methods_fp32": torch.float32,
        "torch_need_autocast_promote": torch.float32,
    }
    cases = []
    for name, dtype in expect.items():
        for entry in getattr(lists, name):
            op, args = entry[0], entry[1]
            extra = entry[2] if len(entry) > 2 else None
            kwargs = extra if isinstance(extra, dict) else {}
            if op.startswith("cudnn_"):
                continue  # cuDNN's own kernels: CUDA registers them beside the shared lists
            if not isinstance(args, tuple):
                # einsum's entry pairs a 4-d equation with 2-d matrices (and its
                # arguments are out of place): an einsum case of its own follows.
                args, kwargs = ("ij,jk->ik", *entry[2]), {}
            cases.append(pytest.param(name, op, args, kwargs, dtype, id=f"{name}-{op}-{len(cases)}"))
    for name in ("torch_expect_builtin_promote", "methods_expect_builtin_promote"):
        for op, args, dtype in getattr(lists, name):
            cases.append(pytest.param(name, op, args, {}, dtype, id=f"{name}-{op}-{len(cases)}"))
    return cases


def _module_of(list_name):
    if list_name.startswith("nn_"):
        return torch._C._nn
    if list_name.startswith("linalg_"):
        return torch._C._linalg
    if list_name.startswith("methods_"):
        return None
    return torch


def _call(list_name, op, args, kwargs):
    module = _module_of(list_name)
    if module is not None and hasattr(module, op):
        return getattr(module, op)(*args, **kwargs)
    return getattr(args[0], op)(*args[1:], **kwargs)


def _to(value, device, dtype=None):
    if isinstance(value, torch.Tensor):
        value = value.to(device)
        return value.to(dtype) if dtype is not None and value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, device, dtype) for v in value)
    return value


def _first_tensor(result):
    if isinstance(result, torch.Tensor):
        return result
    return next(r for r in result if isinstance(r, torch.Tensor))


@pytest.mark.parametrize("list_name, op, args, kwargs, expected", _cases())
def test_autocast_lists_give_cudas_dtypes_and_cpus_values(list_name, op, args, kwargs, expected):
    before = [a.cpu().clone() if isinstance(a, torch.Tensor) else a for a in args]
    # The promotion lists mix float16 and float32 inputs: autocast to float16
    # there, as CUDA's tests do (a float16 input in a bfloat16 region is an error
    # on every device).
    amp = torch.float16 if "promote" in list_name else LOW
    with torch.autocast("neuron", dtype=amp):
        assert torch.is_autocast_enabled("neuron") and torch.get_autocast_dtype("neuron") == amp
        result = _call(list_name, op, args, kwargs)
    if not isinstance(result, (torch.Tensor, tuple, list)):
        return  # equal() returns a bool: its inputs' promotion is what is tested
    got = _first_tensor(result)
    if got.dtype != torch.bool:
        assert got.dtype == expected, f"{op}: {got.dtype}, CUDA's lists prescribe {expected}"
    # The values: the op on CPU with the arguments cast as the policy casts them.
    cast_to = expected if list_name.endswith(("fp16", "fp32", "promote")) and "builtin" not in list_name else None
    want = _first_tensor(_call(list_name, op, _to(args, "cpu", cast_to), kwargs))
    tol = 3e-2 if got.dtype == LOW else 1e-2  # CPU computes bfloat16 ops differently (accumulation)
    if got.dtype == LOW and want.dtype == LOW:
        # The lists' inputs are unseeded, and a composite op (gru_cell) rounds at
        # every step on CPU: CPU's own bfloat16 result can be 0.07 from float32's.
        # Neuron's result must be as close to the float32 truth as CPU's is.
        truth = _first_tensor(_call(list_name, op, _to(args, "cpu", torch.float32), kwargs))
        cpu_error = (want.float() - truth).abs().nan_to_num(0.0).max().item()
        torch.testing.assert_close(got.cpu().float(), truth, rtol=tol, atol=tol + cpu_error, equal_nan=True)
    else:
        torch.testing.assert_close(got.cpu(), want, rtol=tol, atol=tol, equal_nan=True)
    for a, b in zip(args, before):  # arguments untouched
        if isinstance(a, torch.Tensor):
            assert torch.equal(a.cpu(), b)


def test_binary_cross_entropy_is_refused_as_on_cuda():
    x = torch.rand(4, 4, device="neuron")
    with torch.autocast("neuron", dtype=LOW):
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            torch.nn.functional.binary_cross_entropy(x, x)


def test_autocast_availability_nesting_and_disabling():
    assert torch.amp.is_autocast_available("neuron")
    a = torch.randn(8, 8, device="neuron")
    with torch.autocast("neuron", dtype=torch.float16):
        assert (a @ a).dtype == torch.float16
        with torch.autocast("neuron", dtype=torch.bfloat16):
            assert torch.get_autocast_dtype("neuron") == torch.bfloat16
            assert (a @ a).dtype == torch.bfloat16
            with torch.autocast("neuron", enabled=False):
                assert (a @ a).dtype == torch.float32
        assert (a @ a).dtype == torch.float16
    assert (a @ a).dtype == torch.float32
    assert not torch.is_autocast_enabled("neuron")


def test_weights_are_cast_once_per_region():
    layer = torch.nn.Linear(16, 16).to("neuron")
    x = torch.randn(4, 16, device="neuron")
    torchneuron.reset_stats()
    with torch.autocast("neuron", dtype=LOW):
        for _ in range(3):
            layer(x)
    # The weight and bias are cast once (cached: leaves that require grad),
    # the input at each call.
    assert stats.dispatched["aten._to_copy.default"] == 2 + 3


@pytest.mark.parametrize("mode", ["op", "adaptive"])
def test_autocast_in_each_eager_mode_and_under_torch_compile(mode):
    torchneuron.set_eager_mode(mode)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                                torch.nn.Linear(32, 4))
    x = torch.randn(8, 16)
    with torch.autocast("cpu", dtype=LOW):
        want = model(x)
    model.to("neuron")
    compiled = torch.compile(model, backend="neuron")
    for run in (model, compiled):
        with torch.autocast("neuron", dtype=LOW):
            got = run(x.to("neuron"))
        assert got.dtype == LOW
        torch.testing.assert_close(got.cpu(), want, rtol=3e-2, atol=3e-2)


# -- GradScaler ----------------------------------------------------------------

def test_grad_scaler_kernels_run_compiled_and_match_cpu():
    torch.manual_seed(0)
    grads = [torch.randn(5, 3), torch.randn(7) * 100, torch.randn(2, 2).half()]
    results = {}
    torchneuron.reset_stats()
    for device in ("cpu", "neuron"):
        gs = [g.clone().to(device) for g in grads]  # .to("cpu") would alias
        found = torch.zeros(1, device=device)
        inv = torch.full((1,), 0.25, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(gs, found, inv)
        clean = found.clone()
        gs[1][3] = math.inf
        torch._amp_foreach_non_finite_check_and_unscale_(gs, found, inv)
        scale = torch.full((1,), 1024.0, device=device)
        tracker = torch.zeros(1, dtype=torch.int32, device=device)
        history = []
        for inf in (0.0, 0.0, 1.0, 0.0, 0.0):
            torch._amp_update_scale_(scale, tracker, torch.full((1,), inf, device=device), 2.0, 0.5, 2)
            history += [scale.item(), tracker.item()]
        results[device] = ([g.cpu() for g in gs], clean.item(), found.item(), history)
    for got, want in zip(results["neuron"][0], results["cpu"][0]):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert results["neuron"][1:] == results["cpu"][1:]
    # growth_interval 2: grow after two clean steps, halve after an inf.
    assert results["cpu"][1:] == (0.0, 1.0, [1024.0, 1, 2048.0, 0, 1024.0, 0, 1024.0, 1, 2048.0, 0])
    assert stats.host_fallback["aten._amp_foreach_non_finite_check_and_unscale_.default"] == 0
    assert stats.host_fallback["aten._amp_update_scale_.default"] == 0


# -- the demo GPT in mixed precision ---------------------------------------------

CFG = GPTConfig(dropout=0.0)
STEPS = 20


@pytest.fixture(scope="module")
def cpu_float32_losses():
    return train_gpt("cpu", STEPS, cfg=CFG)


@pytest.mark.compile_wait  # compiled numerics; the host tier of a first meeting rounds as CPU
def test_gpt_trains_in_bfloat16_with_grad_scaler_as_cpu_does(cpu_float32_losses):
    runs = [train_gpt("neuron", STEPS, cfg=CFG, autocast=torch.bfloat16, grad_scaler=True) for _ in range(2)]
    if torchneuron.get_eager_mode() == "op":
        assert runs[0] == runs[1]  # deterministic: the same executables
    else:  # graphs cut where the queue ran dry: a reduction fused with other neighbours may sum in another order
        assert runs[0] == pytest.approx(runs[1], rel=1e-3)
    # bfloat16 training of this model leaves float32's path at step 13 (a loss
    # spike of 13%) on CPU too: each step is compared with CPU's own bfloat16
    # autocast, and the steps before the spike with CPU float32.
    cpu_bf16 = train_gpt("cpu", STEPS, cfg=CFG, autocast=torch.bfloat16, grad_scaler=True)
    for step, (got, want, fp32) in enumerate(zip(runs[0], cpu_bf16, cpu_float32_losses)):
        assert abs(got - want) <= 0.02 * abs(want), f"step {step}: {got} vs CPU bfloat16 {want}"
        if step < 12:
            assert abs(got - fp32) <= 0.02 * abs(fp32), f"step {step}: {got} vs CPU float32 {fp32}"


@pytest.mark.thorough  # (170 s of compiles; the bfloat16 run above trains the same GPT with a scaler in CI)
@pytest.mark.compile_wait  # compiled numerics; the host tier of a first meeting rounds as CPU
def test_gpt_trains_in_float16_with_grad_scaler(cpu_float32_losses):
    losses = train_gpt("neuron", STEPS, cfg=CFG, autocast=torch.float16, grad_scaler=True)
    for step, (got, want) in enumerate(zip(losses, cpu_float32_losses)):
        assert abs(got - want) <= 0.02 * abs(want), f"step {step}: {got} vs CPU float32 {want}"


def test_a_step_with_an_inf_gradient_is_skipped_and_the_scale_halves():
    scales = []
    snapshots = collections.OrderedDict()

    def poison(step, model):
        snapshots[step] = [p.detach().cpu().clone() for p in model.parameters()]
        if step == 3:
            next(model.parameters()).grad.view(-1)[0] = math.inf

    state = {}

    def keep_model(step, model):
        poison(step, model)
        state["model"] = model

    train_gpt("neuron", 5, cfg=CFG, autocast=torch.bfloat16, grad_scaler=True, scales=scales,
              after_backward=keep_model)
    assert scales[3] == scales[2] / 2
    assert scales[2] == scales[1] == scales[0] == 65536.0
    # Step 3 left every parameter as it was; step 4 moved them again.
    after_3 = snapshots[4]
    assert all(torch.equal(a, b) for a, b in zip(snapshots[3], after_3))
    final = [p.detach().cpu() for p in state["model"].parameters()]
    assert not all(torch.equal(a, b) for a, b in zip(after_3, final))


@pytest.mark.parametrize("name", ["layer_norm", "batch_norm"])
def test_statistics_saved_in_float32_feed_a_backward_on_the_host(name):
    """A compiled bfloat16 norm saves float32 statistics (its meta kernel's
    types), PyTorch's CPU kernel saves bfloat16 ones; a backward that runs on
    the host (its executable still compiling) accepts the former."""
    torchneuron.config.set(compile_wait=False)  # a first call: on the host while it compiles
    torch.manual_seed(0)
    x = torch.randn(6, 40, 3, dtype=torch.bfloat16)
    grad = torch.randn_like(x)
    w = torch.randn(40, dtype=torch.bfloat16)
    if name == "layer_norm":
        op = torch.ops.aten.native_layer_norm_backward.default
        x, grad = x.transpose(1, 2).contiguous(), grad.transpose(1, 2).contiguous()
        mean, rstd = x.float().mean(2, keepdim=True), torch.rand(6, 3, 1) + 0.5
        args = [grad, x, [40], mean, rstd, w, w, [True, True, True]]
        stat_at = (3, 4)
    else:
        op = torch.ops.aten.native_batch_norm_backward.default
        mean, rstd = torch.randn(40), torch.rand(40) + 0.5
        args = [grad, x, w, None, None, mean, rstd, True, 1e-5, [True, True, True]]
        stat_at = (5, 6)
    on_cpu = list(args)
    for i in stat_at:
        on_cpu[i] = args[i].to(torch.bfloat16)  # what the CPU forward would have saved
    expected = op(*on_cpu)
    moved = [a.to("neuron") if isinstance(a, torch.Tensor) else a for a in args]
    got = op(*moved)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g.cpu(), e)
    for m, a in zip(moved, args):
        if isinstance(a, torch.Tensor):
            assert m.dtype == a.dtype
            torch.testing.assert_close(m.cpu(), a, rtol=0, atol=0)
