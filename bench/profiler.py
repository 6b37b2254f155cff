"""What torch.profiler with neuron's device events costs: the demo training
step with the profiler's code not loaded, loaded and not recording, and
recording, in one run.

    python bench/profiler.py [--steps 20] [--rounds 5] [--write docs/benchmarks.md]

Recording: one process per mode runs the cases in turn, round after round
(not recording; device events only; torch's CPU ops only; both), so machine
noise hits them alike. Loading: fresh processes in turn, with the profiler's
Python side not loaded (TORCHNEURON_PROFILER=0) and loaded, none recording.
All share one executable cache that a first process fills; each process warms
up (its executables load from the cache) before timing. Figures are medians
of the second half of each round, then the median over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TORCHNEURON_CACHE_DIR", tempfile.mkdtemp(prefix="tn-bench-"))

RECORDING = ("not recording", "device events", "CPU ops only", "device events + CPU ops")


def worker(mode: str, cases: list, steps: int, rounds: int) -> None:
    """Median step time of each case, the cases in turn for `rounds`; prints JSON."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    import torchneuron
    from report import train_step_times
    from torchneuron.models import GPTConfig, train_gpt

    torchneuron.set_eager_mode(mode)
    for _ in range(3):  # every executable loaded (or built, by the first process) before timing
        train_gpt("neuron", 4, cfg=GPTConfig())
        torchneuron.wait_for_compiles()

    def step_time() -> float:
        times = train_step_times("neuron", steps, cfg=GPTConfig())
        return statistics.median(times[len(times) // 2:])

    activities = {"device events": [ProfilerActivity.PrivateUse1], "CPU ops only": [ProfilerActivity.CPU],
                  "device events + CPU ops": [ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]}
    medians = {case: [] for case in cases}
    for _ in range(rounds):
        for case in cases:
            if case in activities:
                with profile(activities=activities[case]) as prof:
                    medians[case].append(step_time())
                if "device" in case:
                    device = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.PrivateUse1)
                    assert device > steps, "the profiler recorded no device events"
            else:
                medians[case].append(step_time())
    print(json.dumps({case: statistics.median(v) for case, v in medians.items()}))


def run_worker(mode: str, cases: list, steps: int, rounds: int, loaded: bool = True) -> dict:
    env = dict(os.environ, TORCHNEURON_PROFILER="1" if loaded else "0")
    out = subprocess.run([sys.executable, __file__, "--worker", mode, json.dumps(cases), "--steps", str(steps),
                          "--rounds", str(rounds)], env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{mode} {cases} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--write")
    parser.add_argument("--worker", nargs=2, metavar=("MODE", "CASES"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker[0], json.loads(args.worker[1]), args.steps, args.rounds)
    from report import command_line, machine, publish

    modes = ("op", "adaptive")
    for mode in modes:
        run_worker(mode, ["device events"], 4, 1)  # fills the cache (compiles included)
    recording = {mode: run_worker(mode, list(RECORDING), args.steps, args.rounds) for mode in modes}
    loading = {(mode, loaded): [] for mode in modes for loaded in (False, True)}
    for _ in range(args.rounds):
        for mode, loaded in loading:
            loading[(mode, loaded)].append(run_worker(mode, ["not recording"], args.steps, 1, loaded)["not recording"])
    lines = [
        "## torch.profiler with device events: what loading and recording cost",
        "",
        f"Command: `{command_line()}`  ",
        f"Machine: {machine()}  ",
        f"The demo training step (GPT, AdamW, dropout), steady: medians of the second half of {args.steps} steps.",
        f"Recording: in one process per mode, the cases in turn for {args.rounds} rounds; `torch.profiler.profile` "
        "with `activities=[PrivateUse1]` (device events), `[CPU]` (torch's own recording of the CPU ops, no "
        "device events) or both.",
        "",
        "| mode | not recording | device events | CPU ops only | device events + CPU ops |",
        "|---|---:|---:|---:|---:|",
    ]
    for mode in modes:
        r = recording[mode]
        base = r["not recording"]
        lines.append(f"| {mode} | {base * 1e3:.1f} ms | " + " | ".join(
            f"{r[c] * 1e3:.1f} ms ({r[c] / base:.2f}x)" for c in RECORDING[1:]) + " |")
    lines += [
        "",
        f"Loading: fresh processes in turn, {args.rounds} rounds, none recording; not loaded: "
        "`TORCHNEURON_PROFILER=0` (the profiler's Python side never imported; the launch path's "
        "`trace.sink` reads remain).",
        "",
        "| mode | not loaded | loaded | loaded / not loaded |",
        "|---|---:|---:|---:|",
    ]
    for mode in modes:
        off, on = (statistics.median(loading[(mode, loaded)]) for loaded in (False, True))
        lines.append(f"| {mode} | {off * 1e3:.1f} ms | {on * 1e3:.1f} ms | {on / off:.2f}x |")
    publish(lines, args.write, "profiler")


if __name__ == "__main__":
    main()
