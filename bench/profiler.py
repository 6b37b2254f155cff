"""What torch.profiler with neuron's device events costs: the demo training
step with and without a profiler recording, in one run.

    python bench/profiler.py [--steps 30] [--rounds 3] [--write docs/benchmarks.md]

Every executable is built first (warm-up, then wait_for_compiles); each round
runs the cases in turn; figures are medians of the second half of each round,
then the median over rounds. Modes: op mode and adaptive eager.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TORCHNEURON_CACHE_DIR", tempfile.mkdtemp(prefix="tn-bench-"))
from report import command_line, machine, write_section  # noqa: E402

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import torchneuron  # noqa: E402
from torchneuron.models import GPTConfig, train_gpt  # noqa: E402


def step_times(mode: str, profiled: bool, steps: int) -> list:
    torchneuron.set_eager_mode(mode)
    times = []
    last = [time.perf_counter()]

    def on_step(step, loss):
        now = time.perf_counter()
        times.append(now - last[0])
        last[0] = now

    def run():
        last[0] = time.perf_counter()
        train_gpt("neuron", steps, cfg=GPTConfig(), on_step=on_step)

    if profiled:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]) as prof:
            run()
        events = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.PrivateUse1)
        assert events > steps, "the profiler recorded no device events"
    else:
        run()
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--write")
    args = parser.parse_args()
    cases = [(mode, profiled) for mode in ("op", "adaptive") for profiled in (False, True)]
    for mode in ("op", "adaptive"):
        for _ in range(3):
            step_times(mode, False, 4)
            torchneuron.wait_for_compiles()
    medians = {case: [] for case in cases}
    for _ in range(args.rounds):
        for case in cases:
            t = step_times(*case, args.steps)
            medians[case].append(statistics.median(t[len(t) // 2:]))
    step = {case: statistics.median(v) for case, v in medians.items()}
    lines = [
        "## torch.profiler with device events: what recording costs",
        "",
        f"Command: `{command_line()}`  ",
        f"Machine: {machine()}  ",
        f"The demo training step (GPT, AdamW, dropout), steady, {args.rounds} rounds of {args.steps} steps, the "
        "cases in turn; medians of the second half of each round. Profiled: "
        "`torch.profiler.profile(activities=[CPU, PrivateUse1])` around the whole round.",
        "",
        "| mode | not profiled | profiled | profiled / not |",
        "|---|---:|---:|---:|",
    ]
    for mode in ("op", "adaptive"):
        off, on = step[(mode, False)], step[(mode, True)]
        lines.append(f"| {mode} | {off * 1e3:.1f} ms | {on * 1e3:.1f} ms | {on / off:.2f}x |")
    text = "\n".join(lines)
    print(text)
    if args.write:
        write_section(args.write, "profiler", text)


if __name__ == "__main__":
    main()
