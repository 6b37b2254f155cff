"""The device's work in torch.profiler (issue: profiling): launches as device
events linked to the CPU ops that issued them, with the user's source line;
host work (compiles, host-path ops, transfers, synchronizations) on rows of
its own; fused graphs list their ops and lines."""

import inspect
import json

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, schedule

import torchneuron
from torchneuron import trace

_ACTIVITIES = [ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]
_DEVICE = torch.autograd.DeviceType.PrivateUse1


def _line_of(fn, text: str) -> str:
    """'file:line' of the line of `fn` containing `text`."""
    lines, first = inspect.getsourcelines(fn)
    for k, line in enumerate(lines):
        if text in line:
            return f"{inspect.getsourcefile(fn)}:{first + k}"
    raise AssertionError(text)


def _device_events(prof) -> list:
    return [e for e in prof.events() if e.device_type == _DEVICE]


def _trace(prof, tmp_path) -> list:
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    return json.loads(path.read_text())["traceEvents"]


def _work(x, w):
    y = torch.relu(x @ w)
    return (y * 2).sum()


@pytest.fixture
def compiled():
    """Op mode with every executable of _work built before profiling."""
    torch.manual_seed(0)
    x, w = torch.randn(300, 300), torch.randn(300, 300)
    xn, wn = x.to("neuron"), w.to("neuron")
    _work(xn, wn).item()
    assert torchneuron.wait_for_compiles(timeout=600)
    _work(xn, wn).item()
    return x, w, xn, wn


@pytest.mark.op_mode  # per-op compiles, cache entries and launches
def test_launches_are_device_events_linked_to_their_ops(compiled, tmp_path):
    x, w, xn, wn = compiled
    with profile(activities=_ACTIVITIES) as prof:
        value = _work(xn, wn).item()
    assert value == pytest.approx(_work(x, w).item(), rel=1e-4)
    events = _device_events(prof)
    names = [e.name for e in events]
    for op in ("aten.mm.default", "aten.relu.default", "aten.mul.Tensor", "aten.sum.default"):
        assert op in names, names
    assert all(e.time_range.end >= e.time_range.start for e in events)
    # Each device event counts as device time of the CPU op that issued it.
    mm = next(a for a in prof.key_averages() if a.key == "aten::mm")
    assert mm.self_device_time_total > 0
    assert trace.sink is None  # off again: the launch path pays nothing

    events = _trace(prof, tmp_path)
    kernels = [e for e in events if e.get("cat") == "kernel"]
    mm_event = next(e for e in kernels if e["name"] == "aten.mm.default")
    assert mm_event["args"]["source"] == _line_of(_work, "x @ w")
    assert "float32[300, 300]" in mm_event["args"]["launch"]
    # An arrow from the launch call on the issuing thread (as cudaLaunchKernel) to the launch.
    import os
    import threading

    calls = [e for e in events if e["name"] == "neuron launch"]
    assert len(calls) == len(kernels)
    call = next(e for e in calls if e["args"]["launch"].startswith("aten.mm.default"))
    assert (call["pid"], call["tid"]) == (os.getpid(), threading.get_native_id())
    assert call["args"]["External id"] == mm_event["args"]["External id"]
    starts = {e["id"]: e for e in events if e.get("cat") == "ac2g" and e["ph"] == "s"}
    ends = {e["id"]: e for e in events if e.get("cat") == "ac2g" and e["ph"] == "f"}
    assert len(starts) == len(ends) == len(kernels)
    arrow = next(i for i, e in ends.items() if e["ts"] == mm_event["ts"] and e["tid"] == mm_event["tid"])
    assert starts[arrow]["ts"] == call["ts"] and starts[arrow]["tid"] == call["tid"]


@pytest.mark.op_mode  # per-op compiles, cache entries and launches
def test_queued_and_inline_launches_and_stream_rows(compiled, tmp_path):
    big = torch.randn(512, 512).to("neuron")  # above the inline size: queued on the timeline
    small = torch.randn(8).to("neuron")  # inline
    for _ in range(2):
        (big * 3).sum().item(), (small * 3).sum().item()
        torchneuron.wait_for_compiles(timeout=600)
    side = torch.neuron.Stream()
    with profile(activities=_ACTIVITIES) as prof:
        a = big * 3
        b = small * 3
        with torch.neuron.stream(side):
            c = big * 3
        torch.neuron.synchronize()
    torch.testing.assert_close(a.cpu(), big.cpu() * 3)
    torch.testing.assert_close(b.cpu(), small.cpu() * 3)
    torch.testing.assert_close(c.cpu(), big.cpu() * 3)
    muls = [e for e in _trace(prof, tmp_path) if e.get("cat") == "kernel" and e["name"] == "aten.mul.Tensor"]
    assert len(muls) == 3
    rows = sorted(e["tid"] for e in muls)
    assert rows[0] == 0 and rows[-1] == side.stream_id  # the side stream's launch on its own row
    assert all(e["dur"] >= 0 for e in muls), [e["dur"] for e in muls]


@pytest.mark.op_mode  # op mode's tier: a first call on the host while it compiles
def test_host_work_compiles_host_ops_transfers_and_syncs(tmp_path):
    torchneuron.reset_stats()
    torchneuron.config.set(compile_wait=False)
    x = torch.randn(37, 41)  # a shape nothing compiled yet
    with profile(activities=_ACTIVITIES) as prof:
        xn = x.to("neuron")
        y = torch.tanh(xn) + 1  # met first: on the host while it compiles
        torch.testing.assert_close(y.cpu(), torch.tanh(x) + 1)
        assert torchneuron.wait_for_compiles(timeout=600)
        torch.tanh(xn).cpu()  # compiled now: launched, then waited for
    events = _trace(prof, tmp_path)
    host = [e for e in events if e["name"].startswith("host op: ")]
    assert any(e["name"] == "host op: aten.tanh.default" and "compiling" in e["args"]["reason"] for e in host)
    assert all(e["args"]["source"].endswith(".py:" + e["args"]["source"].rsplit(":", 1)[1]) for e in host)
    compiles = [e for e in events if e["name"].startswith("compile: ")]
    assert compiles and all(e["args"]["layer"] in ("compiled", "disk", "remote", "service", "peer") for e in compiles)
    transfers = [e for e in events if e["name"].startswith("transfer: ")]
    assert len(transfers) >= 2  # to the device and back
    assert any(int(e["args"]["bytes"]) == x.nbytes for e in transfers)
    assert any(e["name"] == "synchronize: synchronize" for e in events)


def _fused_step(x):
    y = x * 2
    y = y + 1
    return torch.tanh(y).sum()


def test_a_fused_graph_lists_its_ops_and_their_lines(tmp_path):
    torchneuron.config.set(compile_wait=False)
    x = torch.randn(64, 64)
    xn = x.to("neuron")
    with torchneuron.eager_mode("adaptive"):
        for _ in range(3):  # calls met, graph met, graph built
            _fused_step(xn).item()
            assert torchneuron.wait_for_compiles(timeout=600)
        with profile(activities=_ACTIVITIES) as prof:
            value = _fused_step(xn).item()
    assert value == pytest.approx(_fused_step(x).item(), rel=1e-4)
    kernels = [e for e in _trace(prof, tmp_path) if e.get("cat") == "kernel"]
    fused = [e for e in kernels if e["name"].startswith("fused graph")]
    assert fused, "no fused launch recorded"
    # One graph, or several where the recorder cut it, or an op it left to the op path: what
    # earlier code in the process taught it decides. Each op is shown with its own line.
    shown = "; ".join(e["args"].get("ops") or f"{e['name']} at {e['args']['source']}" for e in kernels)
    for op, text in (("aten.mul.Tensor", "x * 2"), ("aten.add.Tensor", "y + 1"), ("aten.tanh.default", "torch.tanh")):
        assert f"{op} at {_line_of(_fused_step, text)}" in shown, shown
    # A graph's line is its first op's.
    assert all(e["args"]["source"] == e["args"]["ops"].split("; ")[0].split(" at ", 1)[1] for e in fused)
    assert any(e["args"]["source"] == _line_of(_fused_step, "x * 2") for e in fused)


@pytest.mark.op_mode  # per-op compiles, cache entries and launches
def test_schedules_and_record_function_keep_working(compiled):
    x, w, xn, wn = compiled
    seen = []
    plan = schedule(wait=1, warmup=1, active=2, repeat=1)
    with profile(activities=_ACTIVITIES, schedule=plan, record_shapes=True, with_stack=True,
                 on_trace_ready=lambda p: seen.append(len(_device_events(p)))) as prof:
        for _ in range(5):
            with torch.profiler.record_function("my step"):
                _work(xn, wn).item()
            prof.step()
    assert len(seen) == 1 and seen[0] >= 2 * 4  # two active steps of four launches each
    assert trace.sink is None


@pytest.mark.op_mode  # per-op compiles, cache entries and launches
def test_parquet_tables(compiled, tmp_path):
    import pyarrow.parquet as pq

    x, w, xn, wn = compiled
    with profile(activities=_ACTIVITIES, record_shapes=True) as prof:
        _work(xn, wn).item()
    paths = torchneuron.profiler.export_parquet(prof, str(tmp_path / "profile"))
    assert sorted(paths) == ["compiles", "events", "lines", "ops"]
    events = pq.read_table(paths["events"]).to_pylist()
    launches = [e for e in events if e["kind"] == "launch"]
    assert {e["name"] for e in launches} >= {"aten.mm.default", "aten.relu.default"}
    mm = next(e for e in launches if e["name"] == "aten.mm.default")
    assert mm["source"] == _line_of(_work, "x @ w") and mm["duration_ns"] > 0
    # The launch links to the CPU op that issued it.
    cpu_mm = [e for e in events if e["kind"] == "cpu_op" and e["name"] == "aten::mm"]
    assert any(e["correlation"] == mm["correlation"] for e in cpu_mm)
    assert any(e["input_shapes"] for e in cpu_mm)
    starts = [e["start_ns"] for e in events]
    assert starts == sorted(starts)
    assert abs(cpu_mm[0]["start_ns"] - mm["start_ns"]) < 5e9  # one clock for both
    lines = {r["source"]: r for r in pq.read_table(paths["lines"]).to_pylist()}
    assert lines[_line_of(_work, "x @ w")]["launches"] >= 2  # mm and relu
    assert "aten.mm.default" in lines[_line_of(_work, "x @ w")]["ops"]
    ops = {r["op"]: r for r in pq.read_table(paths["ops"]).to_pylist()}
    assert ops["aten.mm.default"]["launches"] == 1 and ops["aten.mm.default"]["device_ns"] == mm["duration_ns"]
    assert pq.read_table(paths["compiles"]).num_rows == 0  # everything was built before


_SCRIPT = """
import torch, torchneuron
x = torch.randn(64, 64).to("neuron")
w = torch.randn(64, 64).to("neuron")
for i in range(30):
    y = torch.relu(x @ w)
    noise = torch.rand(64, 64, device="neuron")
    print((y + noise).sum().item() > 0)
"""


@pytest.mark.op_mode  # per-op compiles, cache entries and launches
def test_the_profile_command_reports_lines_ops_and_hints(tmp_path):
    import os
    import subprocess
    import sys

    import pyarrow.parquet as pq

    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    env = dict(os.environ, TORCHNEURON_COMPILE_WAIT="1")  # the report then shows device time
    out = subprocess.run([sys.executable, "-m", "torchneuron.cli", "profile", "--html", str(tmp_path / "t.html"),
                          "--parquet", str(tmp_path / "pq"), str(script)], env=env, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    report = out.stdout
    assert report.count("True") == 30  # the script ran, its output kept
    assert "where the time went" in report and "device executing" in report
    lines = report.split("top source lines")[1].split("top ops")[0]
    assert any(line.endswith(" train.py:6: aten.mm.default, aten.relu.default") or ("train.py:6: " in line and "aten.mm.default" in line) for line in lines.splitlines())
    # rand runs on the host (PyTorch's generator): the hint names its line and why.
    hint = next(h for h in report.split("hints:")[1].splitlines() if "train.py:7: " in h)
    assert "aten.rand" in hint or "aten.uniform_" in hint
    assert "random ops use the CPU-compatible generator" in hint
    page = (tmp_path / "t.html").read_text()
    assert "<svg" in page and "aten.mm.default" in page and (tmp_path / "t.png").stat().st_size > 1000
    ops = {r["op"]: r for r in pq.read_table(str(tmp_path / "pq" / "ops.parquet")).to_pylist()}
    assert ops["aten.mm.default"]["launches"] == 30 and ops["aten.mm.default"]["device_ns"] > 0


def _compiled_fn(x, w):
    h = x @ w
    return torch.tanh(h) * 2


def test_a_torch_compile_graph_lists_its_ops_and_lines(tmp_path):
    x, w = torch.randn(16, 16), torch.randn(16, 16)
    xn, wn = x.to("neuron"), w.to("neuron")
    fn = torch.compile(_compiled_fn, backend="neuron")
    fn(xn, wn).cpu()
    with profile(activities=_ACTIVITIES) as prof:
        out = fn(xn, wn)
        torch.testing.assert_close(out.cpu(), _compiled_fn(x, w), rtol=1e-4, atol=1e-4)
    graphs = [e for e in _trace(prof, tmp_path) if e.get("cat") == "kernel" and e["name"].startswith("torch.compile")]
    assert graphs, "no torch.compile launch recorded"
    ops = graphs[0]["args"]["ops"]
    assert f"at {_line_of(_compiled_fn, 'x @ w')}" in ops and f"at {_line_of(_compiled_fn, 'torch.tanh')}" in ops


@pytest.mark.op_mode  # per-op compiles, cache entries and launches
def test_the_demo_writes_its_profile(tmp_path):
    """`make demo ARGS="--profile DIR"`: the trace, the Parquet tables (loaded with
    pandas, their per-line totals equal to the trace's device time), the report
    and the timeline."""
    import os
    import subprocess
    import sys

    import pandas as pd

    out_dir = tmp_path / "prof"
    env = dict(os.environ, TORCHNEURON_COMPILE_WAIT="0")  # a first run's ops on the host while they build
    out = subprocess.run([sys.executable, "-m", "torchneuron.demo", "--steps", "3", "--width", "32", "--layers", "1",
                          "--context", "16", "--profile", str(out_dir)], env=env, capture_output=True, text=True,
                         timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "where the time went" in out.stdout and "top source lines" in out.stdout
    report = (out_dir / "report.txt").read_text()
    assert "device executing" in report
    page = (out_dir / "timeline.html").read_text()
    assert "<svg" in page and (out_dir / "timeline.png").stat().st_size > 1000

    events = json.loads((out_dir / "trace.json").read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    assert len(kernels) > 100
    trace_device_ns = sum(e["dur"] for e in kernels) * 1000
    lines = pd.read_parquet(out_dir / "parquet" / "lines.parquet")
    ops = pd.read_parquet(out_dir / "parquet" / "ops.parquet")
    table = pd.read_parquet(out_dir / "parquet" / "events.parquet")
    assert lines["device_ns"].sum() == pytest.approx(trace_device_ns, rel=0.01)
    assert ops["device_ns"].sum() == pytest.approx(trace_device_ns, rel=0.01)
    assert (table["kind"] == "launch").sum() == len(kernels)
    # Device time lands on the model's source lines, not on torchneuron's or torch's.
    model = lines[lines["source"].str.contains("models.py", na=False)]
    assert model["device_ns"].sum() > 0.5 * lines["device_ns"].sum()
    # Backward ops (run on autograd's device thread) get their forward op's line.
    unknown = lines[lines["source"] == "<unknown>"]["device_ns"].sum()
    assert unknown < 0.25 * lines["device_ns"].sum()
    compiles = pd.read_parquet(out_dir / "parquet" / "compiles.parquet")
    assert len(compiles) > 0 and set(compiles["layer"]) <= {"compiled", "disk", "remote", "service", "peer",
                                                             "running at stop"}


@pytest.mark.op_mode  # per-op compiles, cache entries and launches
def test_a_build_still_running_when_the_session_stops_is_shown(tmp_path):
    import time

    torchneuron.config.set(compile_wait=False)
    x = torch.randn(29, 31)  # a shape nothing was built for
    xn = x.to("neuron")
    with profile(activities=_ACTIVITIES) as prof:
        y = torch.sin(xn) * 3  # on the host while sin's executable builds in the background
        session = trace.sink
        deadline = time.monotonic() + 60
        while not session.open and time.monotonic() < deadline:
            time.sleep(0.01)  # until the build has begun
        assert session.open
    assert torchneuron.wait_for_compiles(timeout=600)
    torch.testing.assert_close(y.cpu(), torch.sin(x) * 3)
    builds = [e for e in _trace(prof, tmp_path) if e["name"].startswith(("compile: ", "lower: "))]
    running = [e for e in builds if e["args"].get("running_at_stop") == "True"]
    assert running, [e["name"] for e in builds]
    assert all(e["dur"] >= 0 for e in running)


def test_the_profile_command_on_the_demo(tmp_path):
    """`torchneuron profile` on the demo script: the report names the model's lines; HTML and PNG."""
    import os
    import subprocess
    import sys

    import torchneuron.demo

    env = dict(os.environ, TORCHNEURON_COMPILE_WAIT="0")
    out = subprocess.run([sys.executable, "-m", "torchneuron.cli", "profile", "--html", str(tmp_path / "demo.html"),
                          torchneuron.demo.__file__, "--steps", "3", "--width", "32", "--layers", "1",
                          "--context", "16"], env=env, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "loss" in out.stdout  # the demo ran
    lines = out.stdout.split("top source lines")[1].split("top ops")[0]
    assert "models.py:" in lines
    assert (tmp_path / "demo.html").stat().st_size > 1000 and (tmp_path / "demo.png").stat().st_size > 1000
