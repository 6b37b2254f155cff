"""float8 dtypes on the device: storage, copies, views, printing, saving, and
casts to and from every float dtype bit for bit as CPU's (issue 51).

The casts are compared as bit patterns: every one of the 256 float8 codes to
each float dtype, every float16 and bfloat16 pattern to float8, and float32 and
float64 values at and around each float8 rounding boundary, special values and
saturation included."""

import io
import re

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
