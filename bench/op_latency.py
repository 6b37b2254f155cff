"""Per-op latency on neuron vs CPU eager, measured side by side in one run.

    python bench/op_latency.py [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
# An empty persistent cache, so cold figures are cold (set before torch loads).
import tempfile  # noqa: E402

os.environ.setdefault("TORCHNEURON_CACHE_DIR", tempfile.mkdtemp(prefix="tn-bench-"))
from report import command_line, machine, publish, time_interleaved  # noqa: E402

import torchneuron  # noqa: E402

# Steady per-op figures: each op waits for its executable instead of running
# on the host while it builds.
torchneuron.config.set(compile_wait=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--write", help="update this markdown file's op_latency section")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()

    torch.manual_seed(0)
    small_c = torch.randn(16)
    small_n = small_c.to("neuron")
    big_c = torch.randn(1024, 1024)
    big_n = big_c.to("neuron")

    def mode(name):
        return lambda: torchneuron.config.set(execution=name)

    # The execution mode is switched before each timed block, not per call.
    modes = {"compiled": mode("compile"), "host": mode("host")}
    torchneuron.reset_stats()
    tiny = time_interleaved(
        {
            "cpu": lambda: small_c + small_c,
            "compiled": lambda: small_n + small_n,
            "host": lambda: small_n + small_n,
        },
        repeats=args.repeats, inner=1000, setup=modes,
    )
    matmul = time_interleaved(
        {
            "cpu": lambda: big_c @ big_c,
            "compiled": lambda: big_n @ big_n,
            "host": lambda: big_n @ big_n,
        },
        repeats=args.repeats, inner=3, setup=modes,
    )
    torchneuron.config.set(execution="compile")
    parts = _tiny_op_parts(small_n, args.repeats)
    rows = [
        ("tiny op (add, 16 floats), throughput", tiny),
        ("matmul 1024x1024 fp32", matmul),
    ]
    lines = [
        "## Per-op latency: neuron vs CPU eager",
        "",
        f"Command: `{command_line()}`  ",
        f"Machine: {machine()}  ",
        "Neuron compiled: the op as a cached IREE executable, launched asynchronously (timed to",
        "completion). Neuron host: the same op on the recorded host fallback.",
        "",
        "| case | CPU eager | neuron compiled | compiled / CPU | neuron host | host / CPU |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, t in rows:
        lines.append(
            f"| {name} | {_fmt(t['cpu'])} | {_fmt(t['compiled'])} | {t['compiled'] / t['cpu']:.2f}x "
            f"| {_fmt(t['host'])} | {t['host'] / t['cpu']:.2f}x |"
        )
    cpu = tiny["cpu"]
    lines += [
        "",
        "Where a cached tiny op's time goes (each part timed alone, same run), against CPU eager's whole add:",
        "",
        "| part | time | / CPU eager add |",
        "|---|---:|---:|",
    ]
    for name, t in parts.items():
        lines.append(f"| {name} | {_fmt(t)} | {t / cpu:.2f}x |")
    publish(lines, args.write, "op_latency")


def _tiny_op_parts(x, repeats: int) -> dict:
    """The unavoidable parts of one compiled tiny op: reaching a Python kernel
    from PyTorch's dispatcher, allocating the output, and one IREE invoke of
    the cached executable (through the runtime's Python binding) on the lane
    it runs on."""
    from torchneuron import _C
    from torchneuron.dispatch import eager
    from torchneuron.dispatch.op_info import op_info
    from torchneuron.runtime import device_queue

    lib = torch.library.Library("tn_bench", "DEF")
    lib.define("first(Tensor a, Tensor b) -> Tensor")
    lib.impl("first", lambda a, b: a, "PrivateUse1")
    first = torch.ops.tn_bench.first.default

    op = torch.ops.aten.add.Tensor
    plan, _ = eager.plan_for(op, op_info(op), (x, x), {})
    queue = device_queue(x.device.index)
    lane = queue.lane_for(plan.largest)
    out = x + x
    torch.neuron.synchronize()
    views = [lane.import_memory(t, 0, tuple(t.shape), t.dtype) for t in (x, x, out)]
    context, fn = plan.executable.entry(lane)

    def invoke():
        if lane.inline:
            lane.run_inline(context, fn, views, "add")
        else:
            lane.invoke(context, fn, views, None, "add", "bench", None)
            lane.wait(lane.value, queue.index)

    times = time_interleaved(
        {
            "PyTorch dispatcher to a Python kernel that returns its input": lambda: first(x, x),
            "output allocation (torchneuron._C.empty)": lambda: _C.empty((16,), torch.float32, 0),
            f"one IREE invoke ({'inline lane, synchronous entry' if lane.inline else 'task lane, and its wait'})": invoke,
        },
        repeats=repeats, inner=1000,
    )
    times["sum of these parts"] = sum(times.values())
    return times


def _fmt(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} µs" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


if __name__ == "__main__":
    main()
