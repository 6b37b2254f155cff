"""The demo training step under bfloat16 autocast (with GradScaler) against
float32, on neuron and on CPU, in one run.

    python bench/autocast.py [--steps 30] [--rounds 3] [--write docs/benchmarks.md]

Every neuron executable is built before timing (a warm-up round, then
wait_for_compiles): the figures are steady steps, medians of the second half
of each round, the cases interleaved round by round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import tempfile  # noqa: E402

os.environ.setdefault("TORCHNEURON_CACHE_DIR", tempfile.mkdtemp(prefix="tn-bench-"))
from report import command_line, machine, publish  # noqa: E402

import torch  # noqa: E402

import torchneuron  # noqa: E402
from torchneuron.models import GPTConfig, train_gpt  # noqa: E402

CASES = {  # name -> (device, autocast dtype)
    "cpu float32": ("cpu", None),
    "cpu bfloat16 autocast": ("cpu", torch.bfloat16),
    "neuron float32": ("neuron", None),
    "neuron bfloat16 autocast": ("neuron", torch.bfloat16),
}


def step_times(device, dtype, steps):
    times = []
    last = [time.perf_counter()]

    def on_step(step, loss):
        now = time.perf_counter()
        times.append(now - last[0])
        last[0] = now

    last[0] = time.perf_counter()
    losses = train_gpt(device, steps, cfg=GPTConfig(), on_step=on_step, autocast=dtype,
                       grad_scaler=dtype is not None)
    return times, losses


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--write")
    args = parser.parse_args()
    for device, dtype in CASES.values():  # warm-up: every executable built
        step_times(device, dtype, 4)
    torchneuron.wait_for_compiles()
    steady = {name: [] for name in CASES}
    final_loss = {}
    for _ in range(args.rounds):
        for name, (device, dtype) in CASES.items():
            t, losses = step_times(device, dtype, args.steps)
            steady[name].append(statistics.median(t[len(t) // 2:]))
            final_loss[name] = losses[-1]
    med = {k: statistics.median(v) for k, v in steady.items()}
    base = med["cpu float32"]
    rows = [f"| {name} | {med[name] * 1e3:.1f} ms | {med[name] / base:.2f}x | {final_loss[name]:.4f} |"
            for name in CASES]
    lines = [
        "## Mixed precision: the demo step under bfloat16 autocast",
        "",
        f"Command: `{command_line()}`  ",
        f"Machine: {machine()}  ",
        f"Model: the demo GPT (2 layers, width 64, context 32, batch 8, AdamW, dropout 0.1); autocast runs "
        f"use torch.amp.GradScaler. {args.rounds} rounds of {args.steps} steps, cases interleaved; medians of "
        f"the second half of each round, after every executable was built.",
        "",
        "| case | steady step | / CPU float32 | loss after the last step |",
        "|---|---:|---:|---:|",
        *rows,
        "",
        f"neuron bfloat16 / neuron float32: {med['neuron bfloat16 autocast'] / med['neuron float32']:.2f}x; "
        f"neuron bfloat16 / CPU bfloat16: {med['neuron bfloat16 autocast'] / med['cpu bfloat16 autocast']:.2f}x.",
    ]
    publish(lines, args.write, "autocast")


if __name__ == "__main__":
    main()
