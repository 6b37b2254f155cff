"""What torch.profiler with neuron's device events costs: the demo training
step without the profiler's code loaded, with it loaded and not recording,
and recording, in one run.

    python bench/profiler.py [--steps 30] [--rounds 3] [--write docs/benchmarks.md]

Each case runs in a fresh process (the profiler's Python side loads at
import unless TORCHNEURON_PROFILER=0), all sharing one executable cache that
a first process fills; each process warms up (its executables load from the
cache) and then times a round of steps. Cases run in turn, round after
round, so machine noise hits them alike; figures are medians of the second
half of each round, then the median over rounds. Modes: op and adaptive.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TORCHNEURON_CACHE_DIR", tempfile.mkdtemp(prefix="tn-bench-"))

CASES = ("not loaded", "loaded, not recording", "recording CPU only", "recording")


def worker(mode: str, case: str, steps: int) -> None:
    """Time `steps` demo steps in this process; prints the step times as JSON."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    import torchneuron
    from torchneuron.models import GPTConfig, train_gpt

    assert ("torchneuron.profiler" in sys.modules) == (case != "not loaded")
    torchneuron.set_eager_mode(mode)
    for _ in range(3):  # every executable loaded (or built, by the first process) before timing
        train_gpt("neuron", 4, cfg=GPTConfig())
        torchneuron.wait_for_compiles()
    times = []
    last = [time.perf_counter()]

    def on_step(step, loss):
        now = time.perf_counter()
        times.append(now - last[0])
        last[0] = now

    def run():
        last[0] = time.perf_counter()
        train_gpt("neuron", steps, cfg=GPTConfig(), on_step=on_step)

    if case == "recording":
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]) as prof:
            run()
        events = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.PrivateUse1)
        assert events > steps, "the profiler recorded no device events"
    elif case == "recording CPU only":  # torch's own recording of the CPU ops, for comparison
        with profile(activities=[ProfilerActivity.CPU]):
            run()
    else:
        run()
    print(json.dumps(times))


def run_case(mode: str, case: str, steps: int) -> list:
    env = dict(os.environ, TORCHNEURON_PROFILER="0" if case == "not loaded" else "1")
    out = subprocess.run([sys.executable, __file__, "--worker", mode, case, "--steps", str(steps)], env=env,
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{mode}/{case} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--write")
    parser.add_argument("--worker", nargs=2, metavar=("MODE", "CASE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(*args.worker, args.steps)
    from report import command_line, machine, write_section

    cases = [(mode, case) for mode in ("op", "adaptive") for case in CASES]
    for mode in ("op", "adaptive"):
        run_case(mode, "recording", 4)  # fills the cache (compiles included)
    medians = {c: [] for c in cases}
    for _ in range(args.rounds):
        for c in cases:
            t = run_case(*c, args.steps)
            medians[c].append(statistics.median(t[len(t) // 2:]))
    step = {c: statistics.median(v) for c, v in medians.items()}
    lines = [
        "## torch.profiler with device events: what loading and recording cost",
        "",
        f"Command: `{command_line()}`  ",
        f"Machine: {machine()}  ",
        f"The demo training step (GPT, AdamW, dropout), steady, {args.rounds} rounds of {args.steps} steps, each "
        "case in a fresh process sharing one warm executable cache, the cases in turn; medians of the second "
        "half of each round, then over rounds. Not loaded: `TORCHNEURON_PROFILER=0` (the profiler's Python "
        "side never imported, the kineto plugin without it). Recording: "
        "`torch.profiler.profile(activities=[CPU, PrivateUse1])` around the round; CPU only: "
        "`activities=[CPU]`, what torch's own recording of the CPU ops costs (no device events).",
        "",
        "| mode | not loaded | loaded, not recording | recording CPU only | recording | loaded / not loaded "
        "| CPU only / not loaded | recording / not loaded |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode in ("op", "adaptive"):
        base, off, cpu, on = (step[(mode, c)] for c in CASES)
        lines.append(f"| {mode} | {base * 1e3:.1f} ms | {off * 1e3:.1f} ms | {cpu * 1e3:.1f} ms | {on * 1e3:.1f} ms | "
                     f"{off / base:.2f}x | {cpu / base:.2f}x | {on / base:.2f}x |")
    text = "\n".join(lines)
    print(text)
    if args.write:
        write_section(args.write, "profiler", text)


if __name__ == "__main__":
    main()
