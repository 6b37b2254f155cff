"""Demo training step (small GPT, AdamW) on neuron vs CPU eager, in one run.

    python bench/train_step.py [--steps 30] [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from report import command_line, machine, write_section  # noqa: E402

import torchneuron  # noqa: E402
from torchneuron.models import GPTConfig, train_gpt  # noqa: E402


def step_times(device: str, steps: int) -> list:
    times, last = [], [time.perf_counter()]

    def on_step(step, loss):
        now = time.perf_counter()
        times.append(now - last[0])
        last[0] = now

    last[0] = time.perf_counter()
    train_gpt(device, steps, cfg=GPTConfig(), on_step=on_step)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--write")
    args = parser.parse_args()
    first = {"cpu": [], "neuron": []}
    steady = {"cpu": [], "neuron": []}
    torchneuron.reset_stats()
    for _ in range(args.rounds):  # alternate devices so noise hits both alike
        for device in ("cpu", "neuron"):
            t = step_times(device, args.steps)
            first[device].append(t[0])
            steady[device].append(statistics.median(t[len(t) // 2:]))
    stats = torchneuron.execution_stats()
    med = {d: statistics.median(v) for d, v in steady.items()}
    fst = {d: statistics.median(v) for d, v in first.items()}
    lines = [
        "## Demo training step: neuron vs CPU eager",
        "",
        f"Command: `{command_line()}`  ",
        f"Machine: {machine()}  ",
        f"Model: GPT 2 layers, width 64, context 32, batch 8, AdamW; {args.rounds} rounds of {args.steps} steps.  ",
        f"Execution path: {stats['ops_on_host_fallback']} of {stats['ops_dispatched']} neuron ops on the host fallback.",
        "",
        "| | CPU eager | neuron | neuron / CPU |",
        "|---|---:|---:|---:|",
        f"| steady-state step (median) | {med['cpu'] * 1e3:.1f} ms | {med['neuron'] * 1e3:.1f} ms | {med['neuron'] / med['cpu']:.2f}x |",
        f"| first step | {fst['cpu'] * 1e3:.1f} ms | {fst['neuron'] * 1e3:.1f} ms | {fst['neuron'] / fst['cpu']:.2f}x |",
    ]
    text = "\n".join(lines)
    print(text)
    if args.write:
        write_section(args.write, "train_step", text)


if __name__ == "__main__":
    main()
