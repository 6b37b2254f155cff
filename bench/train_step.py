"""Demo training step (small GPT, AdamW) on neuron vs CPU eager, in one run.

    python bench/train_step.py [--steps 30] [--rounds 3] [--write docs/benchmarks.md]

The first neuron round starts with an empty executable cache: its first step
is the cold step (with the default settings its ops run on the host while
their executables build in the background; TORCHNEURON_COMPILE_WAIT=1 waits
for each). Then the bench waits until every build has landed; later rounds
give the steady step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
# An empty persistent cache, so cold figures are cold (set before torch loads).
import tempfile  # noqa: E402

os.environ.setdefault("TORCHNEURON_CACHE_DIR", tempfile.mkdtemp(prefix="tn-bench-"))
from report import command_line, machine, publish  # noqa: E402

import torch  # noqa: E402

import torchneuron  # noqa: E402
from torchneuron.models import GPTConfig, train_gpt  # noqa: E402


def step_times(device: str, steps: int, execution: str = "compile"):
    torchneuron.config.set(execution=execution)
    times, compiles = [], []
    last = [time.perf_counter()]

    def on_step(step, loss):
        now = time.perf_counter()
        times.append(now - last[0])
        compiles.append(torchneuron.compile_stats()["compiles"])
        last[0] = now

    start = torchneuron.compile_stats()["compiles"]
    last[0] = time.perf_counter()
    train_gpt(device, steps, cfg=GPTConfig(), on_step=on_step)
    torch.neuron.synchronize()
    return times, [c - start for c in compiles]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--write")
    args = parser.parse_args()
    steady = {"cpu": [], "compiled": [], "host": []}
    cold = cpu_first = None
    for _ in range(args.rounds):  # alternate so that noise hits all alike
        for name, device, execution in (("cpu", "cpu", "compile"), ("compiled", "neuron", "compile"),
                                         ("host", "neuron", "host")):
            started = time.perf_counter()
            t, compiles = step_times(device, args.steps, execution)
            if name == "cpu" and cpu_first is None:
                cpu_first = t[0]
            if name == "compiled" and cold is None:
                torchneuron.wait_for_compiles()
                landed = time.perf_counter() - started
                total = torchneuron.compile_stats()["compiles"]
                waited = torchneuron.execution_stats()["op_compile_seconds_waited"]
                cold = (t[0], landed, total, waited)
                continue  # its steps ran while executables were still landing
            steady[name].append(statistics.median(t[len(t) // 2:]))
    torchneuron.config.set(execution="compile")
    torchneuron.reset_stats()
    train_gpt("neuron", 3, cfg=GPTConfig())
    torch.neuron.synchronize()
    stats = torchneuron.execution_stats()
    compute = stats["ops_compiled"] + stats["ops_on_host_fallback"]
    med = {k: statistics.median(v) for k, v in steady.items()}
    lines = [
        "## Demo training step: neuron vs CPU eager",
        "",
        f"Command: `{command_line()}`  ",
        f"Machine: {machine()}  ",
        f"Model: GPT 2 layers, width 64, context 32, batch 8, AdamW, dropout 0.1; "
        f"{args.rounds} rounds of {args.steps} steps (neuron compiled: the rounds after the cold one), "
        f"medians of the second half of each round.  ",
        f"Compiled path: {stats['ops_compiled']} of {compute} compute ops compiled "
        f"({100 * stats['ops_compiled'] / compute:.1f}%), {stats['ops_on_host_fallback']} on the host "
        f"fallback (random ops), {stats['transfers']} host reads/copies, per 3 steps.",
        "",
        "| | CPU eager | neuron compiled | compiled / CPU | neuron host fallback | host / CPU |",
        "|---|---:|---:|---:|---:|---:|",
        f"| steady-state step | {med['cpu'] * 1e3:.1f} ms | {med['compiled'] * 1e3:.1f} ms | "
        f"{med['compiled'] / med['cpu']:.2f}x | {med['host'] * 1e3:.1f} ms | {med['host'] / med['cpu']:.2f}x |",
        "",
        f"Cold start (empty caches): first step {cold[0]:.2f} s ({cold[0] / cpu_first:.1f}x CPU eager's first "
        f"step, {cpu_first:.2f} s); every one of {cold[2]} compiles landed "
        f"{cold[1]:.1f} s after the first step began; compile seconds the program waited for: {cold[3]:.1f} "
        f"(TORCHNEURON_COMPILE_WAIT={int(torchneuron.config.settings.compile_wait)}). The steady figures "
        f"come from the rounds after that.",
    ]
    publish(lines, args.write, "train_step")


if __name__ == "__main__":
    main()
