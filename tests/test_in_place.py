"""In-place updates give PyTorch's results in every mode.

An executable that overwrites an input while the same dispatch still reads it
at other positions read values it had already written (`x.cumsum_(0)` gave
zeros; adaptive eager's `x.copy_(x.flip(0))` a half-flipped tensor). Such
inputs now get their new values through fresh memory and a copy back
(lowering/aliasing.py); integer inputs written in place compile through a
float carrier of the same width (lowering/carriers.py) instead of running on
the host.
"""

import warnings

import pytest
import torch

import torchneuron
from torchneuron.dispatch import stats
from torchneuron.lowering.aliasing import hazardous_inputs

N = 1 << 16  # large enough that a dispatch spans many tiles


def _ramp(dtype=torch.float32, n=N):
    return (torch.arange(n) % 97 - 40).to(dtype) / (7 if dtype.is_floating_point else 1)


def _run_both(fn, *cpu_args):
    """fn on CPU and on neuron copies of the arguments; returns both argument lists."""
    dev_args = [a.to("neuron") for a in cpu_args]
    fn(*cpu_args)
    fn(*dev_args)
    return cpu_args, [a.cpu() for a in dev_args]


def _assert_args_equal(cpu_args, dev_args):
    for c, d in zip(cpu_args, dev_args):
        assert c.dtype == d.dtype
        torch.testing.assert_close(d, c, rtol=1e-4, atol=1e-3)


# -- the analysis --------------------------------------------------------------

class _Module(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, t, o):
        self.fn(t, o)
        return ()


@pytest.mark.parametrize("fn, expected", [
    (lambda t, o: t.cumsum_(0), [0]),
    (lambda t, o: t.copy_(t.flip(0)), [0]),
    (lambda t, o: t.add_(t.flip(0).sum(0, keepdim=True) + t.roll(1, 0)), [0]),
    (lambda t, o: t.index_put_((torch.tensor([1, 2]),), t[3:5]), [0]),
    (lambda t, o: t.mul_(2.0 / t.norm()), []),  # clip_grad_norm_'s update: a finished reduction
    (lambda t, o: t.copy_(torch.zeros_like(t).add_(2) + o), []),  # zeros_like reads t's shape only
    (lambda t, o: t.add_(o), []),
    (lambda t, o: t.mul_(2.0).add_(1).clamp_(0, 3), []),
    (lambda t, o: t.copy_(o), []),
    (lambda t, o: t.index_put_((torch.tensor([1, 2]),), o[:2]), []),
    (lambda t, o: o.copy_(t.cumsum(0)), []),  # t is only read, o only written
], ids=["cumsum_", "copy_flip", "add_own_roll", "index_put_own_values", "scale_by_own_norm", "shape_only",
        "add_", "pointwise_chain",
        "copy_other", "index_put_other", "write_other"])
def test_inputs_whose_new_value_reads_them_out_of_place_are_found(fn, expected):
    program = torch.export.export(_Module(fn), (torch.zeros(10), torch.zeros(10)), strict=False)
    assert hazardous_inputs(program.run_decompositions()) == expected


# -- op mode -------------------------------------------------------------------

@pytest.mark.op_mode
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.int64])
@pytest.mark.parametrize("name, fn", [
    ("cumsum_", lambda x: x.cumsum_(0)),
    ("cumprod_", lambda x: x.view(-1, 4).cumprod_(1)),
])
def test_scans_in_place_match_cpu_and_run_compiled(name, fn, dtype):
    torchneuron.reset_stats()
    x = _ramp(dtype) % 3 if name == "cumprod_" else _ramp(dtype)
    cpu_args, dev_args = _run_both(fn, x)
    _assert_args_equal(cpu_args, dev_args)
    assert stats.host_fallback[f"aten.{name}.default"] == 0, stats.fallback_reasons


@pytest.mark.op_mode
@pytest.mark.parametrize("name, fn", [
    # vLLM's top-p filter: probs_sort.cumsum(dim=-1, out=probs_sort)
    ("cumsum", lambda x: torch.cumsum(x.view(-1, 64), -1, out=x.view(-1, 64))),
    ("add", lambda x: torch.add(x, x.flip(0), out=x)),
    ("mul", lambda x: torch.mul(x[: N // 2], 2.0, out=x[N // 2:])),  # other elements of the same storage
])
def test_out_arguments_that_are_inputs_too_run_compiled(name, fn):
    """An out= argument sharing memory with an input the op reads: the op
    reads a copy of that input (as PyTorch's kernels read all of it before
    writing) and runs compiled, not on the host."""
    torchneuron.reset_stats()
    cpu_args, dev_args = _run_both(fn, _ramp())
    _assert_args_equal(cpu_args, dev_args)
    op = f"aten.{name}.out"
    assert stats.host_fallback[op] == 0 and stats.host_while_compiling[op] == 0, stats.fallback_reasons
    assert stats.compiled[op] == 1


@pytest.mark.op_mode
@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64])
def test_integer_updates_in_place_run_compiled(dtype):
    torchneuron.reset_stats()
    x = _ramp(dtype, 64)
    counter = torch.zeros((), dtype=dtype)  # 0-d, as GradScaler's growth tracker

    def update(x, counter):
        x.add_(3)
        x.mul_(2)
        counter.add_(1)

    cpu_args, dev_args = _run_both(update, x, counter)
    for c, d in zip(cpu_args, dev_args):
        assert torch.equal(c, d)
    assert stats.host_fallback["aten.add_.Tensor"] == 0, stats.fallback_reasons
    assert stats.host_fallback["aten.mul_.Tensor"] == 0, stats.fallback_reasons


@pytest.mark.op_mode
def test_a_flip_copied_into_its_source_is_whole():
    x = _ramp()
    cpu_args, dev_args = _run_both(lambda x: x.copy_(x.flip(0)), x)
    assert torch.equal(cpu_args[0], dev_args[0])


# -- adaptive eager ------------------------------------------------------------

def test_adaptive_graphs_that_overwrite_what_they_read_match_cpu():
    torchneuron.set_eager_mode("adaptive")
    torchneuron.config.set(compile_wait=False)
    cases = {
        "flip": lambda x: x.copy_(x.flip(0)),
        "cumsum_": lambda x: x.mul_(0.5).cumsum_(0),
        "add_flip": lambda x: x.add_(x.flip(0)),
    }
    for name, fn in cases.items():
        for _ in range(3):  # before and after the graphs' compiles land
            cpu_args, dev_args = _run_both(fn, _ramp())
            torchneuron.wait_for_compiles()
            torch.testing.assert_close(dev_args[0], cpu_args[0], rtol=1e-4, atol=1e-3,
                                       msg=lambda m: f"{name}: {m}")


# -- torch.compile -------------------------------------------------------------

def test_compiled_graphs_that_overwrite_what_they_read_compile_and_match_cpu():
    def flip(x):
        x.copy_(x.flip(0))
        return x.sum()

    def scan(x):
        x.cumsum_(0)
        return x[-1] * 2

    for fn in (flip, scan):
        torch._dynamo.reset()
        torchneuron.reset_stats()
        compiled = torch.compile(fn, backend="neuron")
        x = _ramp()
        d = x.to("neuron")
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "could not be compiled" fallback
            got = compiled(d)
        want = fn(x)
        torch.testing.assert_close(d.cpu(), x, rtol=1e-4, atol=1e-3)
        torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-3)
        assert torchneuron.compile_stats()["dynamo"].get("graphs_fallback", 0) == 0
