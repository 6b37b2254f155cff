"""float8 dtypes on the device: storage, copies, views, printing, saving, and
casts to and from every float dtype bit for bit as CPU's (issue 51).

The casts are compared as bit patterns: every one of the 256 float8 codes to
each float dtype, every float16 and bfloat16 pattern to float8, and float32 and
float64 values at and around each float8 rounding boundary, special values and
saturation included."""

import io
import json
import os
import re
import subprocess
import sys

import pytest
import torch

import torchneuron

FLOAT8 = [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
          torch.float8_e8m0fnu]
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bit patterns (NaN payloads and signed zeros compare too)."""
    t = t.cpu()
    return t if t.dtype == torch.bool or not (t.dtype.is_floating_point) else t.view(_BITS[t.dtype.itemsize])


def assert_same_bits(neuron_value, cpu_value, what=""):
    assert neuron_value.device.type == "neuron"
    assert neuron_value.dtype == cpu_value.dtype, what
    ours, theirs = bits(neuron_value), bits(cpu_value)
    differ = (ours != theirs).nonzero().flatten()
    assert differ.numel() == 0, f"{what}: {differ.numel()} differ, first at {differ[:4].tolist()}: " \
        f"{ours[differ[:4]].tolist()} vs CPU's {theirs[differ[:4]].tolist()}"


def all_codes(dtype):
    return torch.arange(256, dtype=torch.uint8).view(dtype)


def boundary_values(dtype) -> torch.Tensor:
    """float64 values at, between and one float32 step around every pair of
    neighbouring float8 values, beyond the largest, and the special values."""
    values = all_codes(dtype).to(torch.float64)
    values = values[values.isfinite()].unique()
    middle = (values[1:] + values[:-1]) / 2
    points = torch.cat([values, middle, values[-1:] * 1.0625, values[-1:] * 2, values[-1:] * 1e30])
    f32 = points.to(torch.float32)
    up = torch.nextafter(f32, torch.tensor(float("inf")))
    down = torch.nextafter(f32, torch.tensor(float("-inf")))
    special = torch.tensor([0.0, float("inf"), float("nan"), 1e-30, 1e-45, 3e38, 65504.0, 57344.0, 448.0, 240.0])
    out = torch.cat([points, up.double(), down.double(), special.double()])
    return torch.cat([out, -out])


def sources(dtype):
    """Each float source dtype's inputs to a cast to `dtype`: every float16
    and bfloat16 bit pattern; float32 and float64 boundary values (float64 ones
    also halfway between float32 neighbours: CPU rounds to float32 first)."""
    edge = boundary_values(dtype)
    f64 = torch.cat([edge, edge + edge.abs() * 2.0 ** -25, torch.randn(4096, dtype=torch.float64) * 300])
    every16 = torch.arange(-(2 ** 15), 2 ** 15, dtype=torch.int32).to(torch.int16)
    return {
        torch.float32: torch.cat([edge.to(torch.float32), every16.view(torch.bfloat16).to(torch.float32)]),
        torch.float64: f64,
        torch.float16: every16.view(torch.float16),
        torch.bfloat16: every16.view(torch.bfloat16),
    }


@pytest.fixture
def strict_compile():
    """No cast may reach the host path: a compile failure fails the test."""
    torchneuron.reset_stats()
    yield
    assert torchneuron.fallback_ops() == {}, torchneuron.compile_stats()["not_compiled"]
    assert torchneuron.execution_stats()["ops_on_host_fallback"] == 0


@pytest.mark.compile_wait
@pytest.mark.parametrize("dtype", FLOAT8, ids=str)
def test_casts_to_and_from_float8_equal_cpus_bit_for_bit(dtype, strict_compile):
    for source, x in sources(dtype).items():
        assert_same_bits(x.to("neuron").to(dtype), x.to(dtype), f"{source} -> {dtype}")
    codes = all_codes(dtype)
    on_device = codes.to("neuron")
    for target in FLOATS:
        assert_same_bits(on_device.to(target), codes.to(target), f"{dtype} -> {target}")
    finite = codes[codes.to(torch.float32).isfinite()]
    for target in (torch.int32, torch.bool):
        assert_same_bits(finite.to("neuron").to(target), finite.to(target), f"{dtype} -> {target}")
    other = torch.float8_e5m2 if dtype == torch.float8_e4m3fn else torch.float8_e4m3fn
    assert_same_bits(on_device.to(other), codes.to(other), f"{dtype} -> {other}")
    assert torch.equal(bits(codes), bits(on_device)), "the cast changed its input"


@pytest.mark.compile_wait
def test_a_compiled_graph_scales_and_casts_to_float8_as_cpu(strict_compile):
    """The float8 recipe's cast (amax, scale, clamp, cast) in one torch.compile graph."""

    def quantize(x):
        amax = x.abs().amax().to(torch.float64).clamp(min=1e-12)
        scale = (448.0 / amax).to(torch.float32)
        q = (x.to(torch.float32) * scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        return q, q.to(torch.bfloat16) / scale

    x = torch.randn(64, 48, dtype=torch.bfloat16)
    compiled = torch.compile(quantize, backend="neuron", options={"strict": True})
    q, back = compiled(x.to("neuron"))
    q_cpu, back_cpu = quantize(x)
    assert_same_bits(q, q_cpu, "quantized")
    torch.testing.assert_close(back.cpu(), back_cpu, rtol=0, atol=0)
    assert torchneuron.compile_stats()["dynamo"].get("graphs_compiled", 0) >= 1


@pytest.mark.parametrize("dtype", FLOAT8, ids=str)
def test_storage_copies_views_printing_and_saving(dtype):
    codes = all_codes(dtype)
    n = torch.empty(256, dtype=dtype, device="neuron")
    n.copy_(codes)
    assert n.dtype == dtype and n.element_size() == 1
    assert torch.equal(bits(n), bits(codes))
    # views and bit casts both ways, on the device
    assert torch.equal(bits(n[3:200:7]), bits(codes[3:200:7]))
    assert torch.equal(bits(n.reshape(16, 16).t().contiguous()), bits(codes.reshape(16, 16).t().contiguous()))
    assert torch.equal(n.view(torch.uint8).cpu(), codes.view(torch.uint8))
    assert torch.equal(n.view(torch.uint8).view(dtype).view(torch.int8).cpu(), codes.view(torch.int8))
    assert torch.equal(bits(torch.cat([n[:5], n[-5:]])), bits(torch.cat([codes[:5], codes[-5:]])))
    # a copy into a slice of a float8 tensor on the device
    m = torch.zeros(256, dtype=dtype, device="neuron") if dtype != torch.float8_e8m0fnu else n.clone()
    m[10:20] = n[100:110]
    expected = (torch.zeros(256, dtype=dtype) if dtype != torch.float8_e8m0fnu else codes.clone())
    expected[10:20] = codes[100:110]
    assert torch.equal(bits(m), bits(expected))
    # printing: CPU's text, on neuron
    small = codes[60:70]
    assert re.sub(r"device='neuron:0',\s*", "", repr(small.to("neuron"))).split() == repr(small).split()
    # torch.save of a neuron tensor loads as a neuron tensor with the same bits
    buffer = io.BytesIO()
    torch.save(n, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)
    assert loaded.device.type == "neuron" and loaded.dtype == dtype
    assert torch.equal(bits(loaded), bits(codes))


@pytest.mark.compile_wait
@pytest.mark.parametrize("op", ["add", "mul_scalar", "max", "sum", "lt", "clamp"])
def test_an_op_cpu_has_no_float8_kernel_for_raises_cpus_error(op):
    x = torch.tensor([1.0, -2.0, 0.5]).to(torch.float8_e4m3fn)
    run = {"add": lambda t: t + t, "mul_scalar": lambda t: t * 2, "max": lambda t: t.max(),
           "sum": lambda t: t.sum(), "lt": lambda t: t < t, "clamp": lambda t: t.clamp(-1, 1)}[op]
    with pytest.raises(NotImplementedError) as on_cpu:
        run(x)
    n = x.to("neuron")
    with pytest.raises(NotImplementedError) as on_neuron:
        run(n)
    assert str(on_neuron.value) == str(on_cpu.value)
    assert torch.equal(bits(n), bits(x)), "the failed op changed its input"


@pytest.mark.compile_wait
def test_an_op_cpu_computes_on_float8_gives_cpus_result():
    """CPU multiplies two float8 tensors (in float, rounded to float8): so does neuron, on the host path."""
    x, y = torch.randn(5, 4).to(torch.float8_e4m3fn), torch.randn(5, 4).to(torch.float8_e4m3fn)
    assert torch.equal(bits(x.to("neuron") * y.to("neuron")), bits(x * y))


@pytest.mark.compile_wait
def test_a_compiled_graph_with_float8_arithmetic_runs_as_cpu_does():
    """torch.compile of float8 arithmetic CPU has no kernel for: CPU's error, not IREE's float8 add."""
    x = torch.tensor([1.0, -2.0, 0.5]).to(torch.float8_e4m3fn)
    compiled = torch.compile(lambda t: t + t, backend="neuron")
    with pytest.raises(Exception) as raised:
        compiled(x.to("neuron"))
    chain, e = [], raised.value
    while e is not None:
        chain.append(str(e))
        e = e.__cause__ or e.__context__
    assert any("not implemented for 'Float8_e4m3fn'" in text for text in chain), chain


LAYOUT_OPS = {
    "where": lambda x, y, m, i: torch.where(m, x, y),
    "index_select": lambda x, y, m, i: x.index_select(0, i),
    "index": lambda x, y, m, i: x[i],
    "roll": lambda x, y, m, i: x.roll(1, 0),
    "repeat": lambda x, y, m, i: x.repeat(2, 1),
    "index_put": lambda x, y, m, i: x.clone().index_put_((i,), y[:2]),
    "fill": lambda x, y, m, i: x.clone().fill_(0.75),
    "zeros_like": lambda x, y, m, i: torch.zeros_like(x),
    "stack": lambda x, y, m, i: torch.stack([x, y]),
}


@pytest.mark.compile_wait
def test_ops_that_move_float8_values_compile_and_equal_cpus(strict_compile):
    x, y = torch.randn(4, 6).to(torch.float8_e4m3fn), torch.randn(4, 6).to(torch.float8_e4m3fn)
    m, i = torch.rand(4, 6) > 0.5, torch.tensor([2, 0])
    for name, op in LAYOUT_OPS.items():
        ours = op(x.to("neuron"), y.to("neuron"), m.to("neuron"), i.to("neuron"))
        assert_same_bits(ours, op(x, y, m, i), name)


# -- scaled matmuls ------------------------------------------------------------------

M, K, N = 32, 64, 48


def _operands(dtype_a=torch.float8_e4m3fn, dtype_b=torch.float8_e4m3fn):
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(M, K, generator=g) * 3).to(dtype_a)
    b = (torch.randn(N, K, generator=g) * 3).to(dtype_b).t()  # column-major, as _scaled_mm wants
    return a, b


SCALED_MM_CASES = {
    "tensorwise-float32": dict(scale_a=torch.tensor(0.5), scale_b=torch.tensor(2.0), out_dtype=torch.float32),
    "tensorwise-bias-bfloat16": dict(scale_a=torch.tensor(0.5), scale_b=torch.tensor(2.0),
                                     bias=torch.randn(N).to(torch.bfloat16), out_dtype=torch.bfloat16),
    "rowwise-bfloat16": dict(scale_a=torch.rand(M, 1) + 0.5, scale_b=torch.rand(1, N) + 0.5,
                             out_dtype=torch.bfloat16),
    "float8-out-scale-result": dict(scale_a=torch.tensor(0.5), scale_b=torch.tensor(2.0),
                                    scale_result=torch.tensor(4.0), out_dtype=torch.float8_e4m3fn),
    "e5m2-fast-accum-float16": dict(scale_a=torch.tensor(0.25), scale_b=torch.tensor(1.0),
                                    out_dtype=torch.float16, use_fast_accum=True, e5m2=True),
}


@pytest.mark.compile_wait
@pytest.mark.parametrize("case", SCALED_MM_CASES, ids=str)
def test_scaled_mm_equals_cpus(case, strict_compile):
    kwargs = dict(SCALED_MM_CASES[case])
    a, b = _operands(torch.float8_e5m2 if kwargs.pop("e5m2", False) else torch.float8_e4m3fn)
    expected = torch._scaled_mm(a, b, **kwargs)
    on_device = {k: v.to("neuron") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    na, nb = a.to("neuron"), b.to("neuron")
    ours = torch._scaled_mm(na, nb, **on_device)
    assert ours.dtype == expected.dtype and ours.shape == expected.shape
    if expected.dtype in FLOAT8:  # (a CPU with AMX computes in oneDNN: one float8 step apart at most)
        torch.testing.assert_close(ours.cpu().float(), expected.float(), rtol=0.125, atol=0)
    else:
        torch.testing.assert_close(ours.cpu().float(), expected.float(), rtol=1e-5, atol=1e-3)
    for name, value in [("a", (na, a)), ("b", (nb, b))] + [(k, (on_device[k], v)) for k, v in kwargs.items()
                                                           if isinstance(v, torch.Tensor)]:
        assert torch.equal(bits(value[0]), bits(value[1])), f"_scaled_mm changed {name}"


def test_scaled_mm_with_a_scale_of_the_wrong_shape_raises_cpus_error():
    a, b = _operands()
    bad = dict(scale_a=torch.rand(M), scale_b=torch.tensor(1.0), out_dtype=torch.bfloat16)
    with pytest.raises(ValueError) as on_cpu:
        torch._scaled_mm(a, b, **bad)
    with pytest.raises(ValueError) as on_neuron:
        torch._scaled_mm(a.to("neuron"), b.to("neuron"), **{k: v.to("neuron") if isinstance(v, torch.Tensor) else v
                                                           for k, v in bad.items()})
    assert str(on_neuron.value).split("Got")[0] == str(on_cpu.value).split("Got")[0]


@pytest.mark.compile_wait
def test_scaled_mm_in_adaptive_eager_and_under_torch_compile(strict_compile):
    """The float8 linear's forward (scales from amax, casts, _scaled_mm) as
    adaptive eager graphs and as one torch.compile graph."""

    def linear(x, w):
        def scale_of(t):
            return (448.0 / t.abs().amax().to(torch.float64).clamp(min=1e-12)).to(torch.float32)

        sx, sw = scale_of(x), scale_of(w)
        qx = (x.to(torch.float32) * sx).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        qw = (w.to(torch.float32) * sw).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        return torch._scaled_mm(qx, qw.t(), sx.reciprocal(), sw.reciprocal(), out_dtype=torch.bfloat16)

    x, w = torch.randn(M, K, dtype=torch.bfloat16), torch.randn(N, K, dtype=torch.bfloat16)
    expected = linear(x, w)
    with torchneuron.eager_mode("adaptive"):
        for _ in range(2):
            ours = linear(x.to("neuron"), w.to("neuron"))
            torch.testing.assert_close(ours.cpu(), expected, rtol=1.6e-2, atol=1e-2)
    compiled = torch.compile(linear, backend="neuron", options={"strict": True})
    torch.testing.assert_close(compiled(x.to("neuron"), w.to("neuron")).cpu(), expected, rtol=1.6e-2, atol=1e-2)
    assert torchneuron.compile_stats()["dynamo"].get("graphs_compiled", 0) >= 1


@pytest.mark.compile_wait
def test_int_mm_equals_cpus(strict_compile):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-128, 128, (32, 64), dtype=torch.int8, generator=g)
    y = torch.randint(-128, 128, (64, 48), dtype=torch.int8, generator=g)
    ours = torch._int_mm(x.to("neuron"), y.to("neuron"))
    assert ours.dtype == torch.int32
    assert torch.equal(ours.cpu(), torch._int_mm(x, y))


# -- TorchAO ---------------------------------------------------------------------------

def _train_float8_mlp(device, recipe, steps=10, compiled=False):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    # (layers of one shape: their casts and matmuls share executables)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                                torch.nn.GELU(), torch.nn.Linear(64, 64))
    model = convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    forward = torch.compile(model, backend="neuron") if compiled else model
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(32, 64, generator=g), torch.randn(32, 64, generator=g)
        loss = torch.nn.functional.mse_loss(forward(x.to(device)), y.to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model


@pytest.mark.compile_wait
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_torchao_float8_training_follows_cpu(recipe, strict_compile):
    """TorchAO's convert_to_float8_training (Float8Linear: amax, scales, casts
    and _scaled_mm in forward and backward), 10 SGD steps: CPU's losses and
    weights. (A 20-step float8 GPT run follows CPU only as far as CPU follows
    itself: float8 rounding makes it chaotic, see docs/benchmarks.md.)"""
    cpu_losses, cpu_model = _train_float8_mlp("cpu", recipe)
    losses, model = _train_float8_mlp("neuron", recipe)
    assert type(model[0]).__name__ == "Float8Linear"
    for ours, theirs in zip(losses, cpu_losses):
        assert abs(ours - theirs) <= 1e-4 * abs(theirs), (losses, cpu_losses)
    for (name, p), q in zip(model.named_parameters(), cpu_model.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.compile_wait
def test_torchao_quantized_linear_layers_equal_cpus(strict_compile):
    """quantize_ with int8 weight-only, int8 dynamic activation + int8 weight,
    and int4 weight-only (IntxWeightOnlyConfig, plain aten ops off CUDA): the
    quantized model on neuron gives the quantized model's CPU outputs."""
    import copy

    from torchao.quantization import (Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig,
                                      IntxWeightOnlyConfig, quantize_)

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64))
    x = torch.randn(8, 64)
    for config in (Int8WeightOnlyConfig(), Int8DynamicActivationInt8WeightConfig(),
                   IntxWeightOnlyConfig(weight_dtype=torch.int4)):
        cpu, neuron = copy.deepcopy(base), copy.deepcopy(base).to("neuron")
        quantize_(cpu, config)
        quantize_(neuron, config)
        assert type(neuron[0].weight).__name__ == type(cpu[0].weight).__name__ != "Parameter"
        torch.testing.assert_close(neuron(x.to("neuron")).cpu(), cpu(x), rtol=1e-5, atol=1e-5,
                                   msg=type(config).__name__)


@pytest.mark.compile_wait
@pytest.mark.parametrize("element", ["mxfp8"])  # (mxfp4, packed float4 elements, passed too: 50 s more)
def test_torchao_mx_formats_emulated_equal_cpus(element):
    """TorchAO's MX inference config (block scales in float8_e8m0fnu, elements
    in float8_e4m3fn or packed float4), with its emulated kernel (the one that
    runs off Blackwell GPUs): the quantized layer gives CPU's outputs."""
    import copy

    from torchao.prototype.mx_formats import MXDynamicActivationMXWeightConfig
    from torchao.quantization import quantize_
    from torchao.quantization.quantize_.common import KernelPreference

    dtype = torch.float8_e4m3fn if element == "mxfp8" else torch.float4_e2m1fn_x2
    config = MXDynamicActivationMXWeightConfig(activation_dtype=dtype, weight_dtype=dtype,
                                               kernel_preference=KernelPreference.EMULATED)
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(64, 64)).to(torch.bfloat16)
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    cpu, neuron = copy.deepcopy(base), copy.deepcopy(base).to("neuron")
    quantize_(cpu, config)
    quantize_(neuron, config)
    assert type(neuron[0].weight).__name__ == "MXTensor"
    with torch.no_grad():
        torch.testing.assert_close(neuron(x.to("neuron")).cpu(), cpu(x), rtol=1.6e-2, atol=1e-2)


_FLOAT8_RESTART = """
import json, sys, torch, torchneuron
sys.path.insert(0, {tests!r})
from test_float8 import _train_float8_mlp
runs = {{}}
for mode in ("op", "adaptive", "compiled"):
    with torchneuron.eager_mode("op" if mode == "compiled" else mode):
        losses, _ = _train_float8_mlp("neuron", "tensorwise", steps=3, compiled=mode == "compiled")
    torchneuron.wait_for_compiles()
    runs[mode] = losses
stats = torchneuron.compile_stats()
print(json.dumps({{"losses": runs, "compiled": stats["sources"].get("compiled", 0),
                  "graphs": stats.get("dynamo", {{}}).get("graphs_compiled", 0), "host": torchneuron.fallback_ops()}}))
"""


def test_float8_training_in_every_mode_and_a_restart_compiles_nothing(tmp_path):
    """TorchAO float8 training (tensorwise) in op mode, adaptive eager and
    under torch.compile: CPU's losses in each; a second process with the
    same cache compiles nothing (every executable comes from disk)."""
    cpu_losses, _ = _train_float8_mlp("cpu", "tensorwise", steps=3)
    env = dict(os.environ, TORCHNEURON_CACHE_DIR=str(tmp_path / "cache"), TORCHNEURON_COMPILE_WAIT="1")
    script = _FLOAT8_RESTART.format(tests=os.path.dirname(__file__))
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-4000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    for run in runs:
        assert run["host"] == {}, run
        for mode, losses in run["losses"].items():
            for ours, theirs in zip(losses, cpu_losses):
                assert abs(ours - theirs) <= 1e-4 * abs(theirs), (mode, losses, cpu_losses)
    assert runs[0]["compiled"] > 0 and runs[0]["graphs"] >= 1
    assert runs[1]["compiled"] == 0, runs[1]
