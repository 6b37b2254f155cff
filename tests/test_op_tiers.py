"""Op mode never stalls on a compile: an op whose executable is not built yet
runs on the host path while it is lowered (in the lowering worker) and
compiled in the background; later calls run compiled (issue: adaptive eager,
build item 6)."""

import os
import subprocess
import sys

import pytest
import torch

import torchneuron
from torchneuron.dispatch import eager

pytestmark = pytest.mark.op_mode


@pytest.fixture
def no_wait():
    torchneuron.config.set(compile_wait=False)
    torchneuron.reset_stats()
    yield


def _stats() -> dict:
    return torchneuron.execution_stats()


def _chain(x, w):
    return torch.softmax((x * 1.5 - 0.25) @ w, -1).sum(0)


def test_first_calls_run_on_the_host_while_compiling_then_compiled(no_wait):
    torch.manual_seed(0)
    x, w = torch.randn(9, 13), torch.randn(13, 11)
    xn, wn = x.to("neuron"), w.to("neuron")
    expected = _chain(x, w)
    got = _chain(xn, wn)
    torch.testing.assert_close(got.cpu(), expected)
    torch.testing.assert_close(xn.cpu(), x)  # arguments unchanged
    torch.testing.assert_close(wn.cpu(), w)
    first = _stats()
    assert first["ops_on_host_while_compiling"] >= 4
    assert first["op_builds_in_background"] >= 4
    assert first["op_builds_in_line"] == 0 and first["op_compile_seconds_waited"] == 0
    assert torchneuron.fallback_ops() == {}  # not a fallback: these ops compile

    assert torchneuron.wait_for_compiles(timeout=600)
    got = _chain(xn, wn)
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-5)
    later = _stats()
    assert later["ops_on_host_while_compiling"] == first["ops_on_host_while_compiling"]
    assert later["ops_compiled"] - first["ops_compiled"] >= 4


def test_in_place_and_out_ops_write_the_same_memory_on_either_path(no_wait):
    x = torch.randn(5, 7)
    for _ in range(2):  # first on the host (building), then compiled
        xn = x.to("neuron")
        ptr = xn.data_ptr()
        xn.mul_(2.5).add_(1.0)
        out = torch.empty(5, 7, device="neuron")
        torch.exp(xn, out=out)
        torch.testing.assert_close(xn.cpu(), x * 2.5 + 1.0)
        torch.testing.assert_close(out.cpu(), torch.exp(x * 2.5 + 1.0))
        assert xn.data_ptr() == ptr
        torchneuron.wait_for_compiles(timeout=600)
    assert _stats()["ops_compiled"] >= 3


def test_a_foreach_op_runs_whole_on_the_host_meanwhile(no_wait):
    tensors = [torch.randn(n) for n in (3, 5, 8)]
    neuron = [t.to("neuron") for t in tensors]
    signatures = torchneuron.compile_stats()["signatures"]
    torch._foreach_add_(neuron, 0.5)
    for t, n in zip(tensors, neuron):
        torch.testing.assert_close(n.cpu(), t + 0.5)
    # One signature (the whole foreach op), not one per tensor.
    assert torchneuron.compile_stats()["signatures"] == signatures + 1
    assert _stats()["ops_on_host_while_compiling"] == 1


def test_a_build_that_fails_leaves_the_op_on_the_fallback(no_wait, monkeypatch):
    def refuse(op, info, sig, promote_scalars=False):
        raise torchneuron.lowering.NotCompilable("forced by the test")

    monkeypatch.setattr(eager, "lower_call_elsewhere", refuse)
    x = torch.randn(4, 6)
    xn = x.to("neuron")
    for _ in range(3):
        torch.testing.assert_close(torch.atan(xn * 0.75).cpu(), torch.atan(x * 0.75))
        torchneuron.wait_for_compiles(timeout=600)
    reasons = torchneuron.compile_stats()["not_compiled"]
    assert "forced by the test" in reasons.get("aten.atan.default", "")
    assert torchneuron.fallback_ops().get("aten.atan.default", 0) >= 1


def test_a_build_that_breaks_leaves_the_op_on_the_fallback(no_wait, monkeypatch):
    def crash(op, info, sig, promote_scalars=False):
        raise RuntimeError("builder crashed (forced by the test)")

    monkeypatch.setattr(eager, "lower_call_elsewhere", crash)
    x = torch.randn(5, 3)
    xn = x.to("neuron")
    for _ in range(3):
        torch.testing.assert_close(torch.asinh(xn * 1.25).cpu(), torch.asinh(x * 1.25))
        torchneuron.wait_for_compiles(timeout=600)
    reason = torchneuron.compile_stats()["not_compiled"].get("aten.asinh.default", "")
    assert "background build failed" in reason and "builder crashed" in reason
    assert torchneuron.fallback_ops().get("aten.asinh.default", 0) >= 1


def test_fallback_policy_error_builds_in_line(no_wait):
    torchneuron.config.set(fallback="error")
    x = torch.randn(3, 17)
    got = torch.sinh(x.to("neuron") * 0.5)
    torch.testing.assert_close(got.cpu(), torch.sinh(x * 0.5))
    stats = _stats()
    assert stats["ops_on_host_while_compiling"] == 0
    assert stats["op_builds_in_line"] >= 1 and stats["op_builds_in_background"] == 0


_WORKLOAD = """
import json, torch, torchneuron
x = torch.arange(24.0).reshape(4, 6).to("neuron")
y = (x.cos() * 2 + x).sum(1)
assert torch.allclose(y.cpu(), (torch.arange(24.0).reshape(4, 6).cos() * 2 + torch.arange(24.0).reshape(4, 6)).sum(1))
# masked_fill needs its value as a constant: its build is redone under that
# signature, which this process never calls again.
z = x.masked_fill(x > 7, 0)
assert z.cpu().sum().item() == 28
torchneuron.wait_for_compiles(timeout=600)
print(json.dumps({**torchneuron.execution_stats(), "compiles": torchneuron.compile_stats()["compiles"]}))
"""


def test_a_restarted_process_runs_compiled_from_its_first_call(tmp_path):
    env = dict(os.environ, TORCHNEURON_CACHE_DIR=str(tmp_path / "cache"), TORCHNEURON_COMPILE_WAIT="0",
               TORCHNEURON_DEVICE_COUNT="1")
    import json

    runs = [json.loads(subprocess.run([sys.executable, "-c", _WORKLOAD], env=env, capture_output=True, text=True,
                                      check=True, timeout=600).stdout.splitlines()[-1]) for _ in range(2)]
    assert runs[0]["ops_on_host_while_compiling"] >= 3 and runs[0]["compiles"] >= 3
    assert runs[1]["ops_on_host_while_compiling"] == 0 and runs[1]["compiles"] == 0
    assert runs[1]["ops_compiled"] >= 3


_COLD = """
import gc, json, threading, torch, torchneuron
from torchneuron.compiler import target_cpu
release = threading.Event()
real_probe = target_cpu._probe
target_cpu._probe = lambda d: release.wait(600) and real_probe(d)  # the compiler is slow to answer
x = torch.arange(24.0).reshape(4, 6)
xn = x.to("neuron")
y = (xn.cos() * 2 + xn).sum(1)
ok = torch.allclose(y.cpu(), (x.cos() * 2 + x).sum(1))
while_probing = {"resolved": target_cpu.resolved() is not None, "ok": ok, "x_kept": torch.equal(xn.cpu(), x),
                 **torchneuron.execution_stats()}
frozen = gc.get_freeze_count()
release.set()
torchneuron.wait_for_compiles(timeout=600)
y = (xn.cos() * 2 + xn).sum(1)
print(json.dumps({"while_probing": while_probing, "frozen": frozen, "ok": torch.allclose(y.cpu(), (x.cos() * 2 + x).sum(1)),
                  **torchneuron.execution_stats()}))
"""


@pytest.mark.parametrize("freeze", ["1", "0"])
def test_a_cold_process_does_not_wait_for_its_cpu_to_be_resolved(tmp_path, freeze):
    """With an empty cache the compiler must first tell which CPU this is
    (about 0.2 s): the first ops run on the host meanwhile, and compile
    once it is known. The first op also keeps torch's import-time heap out
    of the garbage collector's scans (TORCHNEURON_GC_FREEZE, on by default)."""
    import json

    env = dict(os.environ, TORCHNEURON_CACHE_DIR=str(tmp_path / "cache"), TORCHNEURON_COMPILE_WAIT="0",
               TORCHNEURON_DEVICE_COUNT="1", TORCHNEURON_GC_FREEZE=freeze)
    proc = subprocess.run([sys.executable, "-c", _COLD], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "leaked" not in proc.stderr  # frozen objects are let go at exit
    run = json.loads(proc.stdout.splitlines()[-1])
    first = run["while_probing"]
    assert not first["resolved"] and first["ok"] and first["x_kept"]
    assert first["ops_on_host_while_compiling"] >= 3 and first["ops_compiled"] == 0
    assert run["ok"] and run["ops_compiled"] >= 3
    assert (run["frozen"] > 10000) == (freeze == "1")
