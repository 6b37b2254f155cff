"""IREE's task pool with one worker per core (the default) against one worker
fewer than cores (TORCHNEURON_DEVICE_WORKERS), measured side by side.

    python bench/device_workers.py [--rounds 2] [--steps 150] [--write docs/benchmarks.md]

The pool's workers and the program's threads (recording, autograd's device
thread, the drawing thread) share the host's cores. Each case runs in a fresh
process (the worker count is fixed when the first device is made), cases
interleaved round by round, one cache directory for the whole run (compiles
land in the first round's warm-up); a case's figure is the median step of
its process, and the table the median over rounds.

Cases: the demo GPT's training step in adaptive eager mode; the same model
under torch.compile(backend="neuron") with AdamW's eager ops in adaptive mode
(Inductor beside it); a 4x wider GPT (n_embd 256, context 64) in adaptive
mode; and a lone 1024x1024 matmul in op mode.
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
from report import command_line, machine, train_step_times, write_section  # noqa: E402

CASES = {
    # name: (what, device, backend, wide)
    "demo step, adaptive eager": ("step", "neuron", None, False),
    "demo step, torch.compile + adaptive eager": ("step", "neuron", "neuron", False),
    "wider GPT step, adaptive eager": ("step", "neuron", None, True),
    "matmul 1024x1024, op mode": ("matmul", "neuron", None, False),
}
REFERENCES = {  # CPU's figure each case is read against
    "demo step, adaptive eager": ("step", "cpu", None, False),
    "demo step, torch.compile + adaptive eager": ("step", "cpu", "inductor", False),
    "wider GPT step, adaptive eager": ("step", "cpu", None, True),
    "matmul 1024x1024, op mode": ("matmul", "cpu", None, False),
}


def child(spec: str, steps: int) -> None:
    what, device, backend, wide = json.loads(spec)
    import torch

    import torchneuron
    from torchneuron.models import GPTConfig, train_gpt

    if what == "matmul":
        a = torch.randn(1024, 1024, device=device)
        times = []
        for i in range(steps // 5 + 5):
            start = time.perf_counter()
            (a @ a).sum().item()
            times.append(time.perf_counter() - start)
        print(json.dumps(statistics.median(times[5:])))
        return
    torchneuron.set_eager_mode("adaptive")
    cfg = GPTConfig(n_embd=256, block_size=64) if wide else GPTConfig()
    n = steps // 4 if wide else steps
    for _ in range(4):  # every graph and executable compiled
        train_gpt(device, 6, cfg=cfg, compile_backend=backend)
        if device == "neuron":
            torchneuron.wait_for_compiles()
    times = train_step_times(device, n, cfg=cfg, compile_backend=backend)
    print(json.dumps(statistics.median(times[len(times) // 4:])))


def run_case(spec: tuple, workers: int, steps: int, env: dict) -> float:
    env = dict(env, TORCHNEURON_DEVICE_WORKERS=str(workers))
    out = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec), "--steps", str(steps)],
                         capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--write")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.steps)
        return
    cores = os.cpu_count() or 1
    env = dict(os.environ, TORCHNEURON_CACHE_DIR=tempfile.mkdtemp(prefix="tn-bench-workers-"),
               TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="tn-bench-inductor-"))
    fewer = max(1, cores - 1)
    columns = {"cpu": None, "all": cores, "fewer": fewer}
    figures = {name: {c: [] for c in columns} for name in CASES}
    for _ in range(args.rounds):
        for name, spec in CASES.items():
            figures[name]["cpu"].append(run_case(REFERENCES[name], 0, args.steps, env))
            for column in ("all", "fewer"):
                figures[name][column].append(run_case(spec, columns[column], args.steps, env))
            print(name, {c: f"{statistics.median(v) * 1e3:.2f} ms" for c, v in figures[name].items()}, flush=True)
    rows = []
    for name, by in figures.items():
        cpu, every, some = (statistics.median(by[c]) * 1e3 for c in ("cpu", "all", "fewer"))
        reference = "Inductor" if "torch.compile" in name else "CPU eager"
        rows.append(f"| {name} | {reference} {cpu:.2f} ms | {every:.2f} ms ({every / cpu:.2f}x) | "
                    f"{some:.2f} ms ({some / cpu:.2f}x) | {some / every:.2f}x |")
    body = "\n".join([
        "## Device workers: one per core against one fewer",
        "",
        f"Command: `{command_line()}`  ",
        f"Machine: {machine()}  ",
        f"Each figure: a fresh process's median step (matmul: median call), median of {args.rounds} interleaved "
        f"rounds. `TORCHNEURON_DEVICE_WORKERS` sets IREE's task pool; the default is one worker per core.",
        "",
        f"| case | reference | {cores} workers (default) | {fewer} worker{'s' if fewer > 1 else ''} | "
        f"{fewer} / {cores} |",
        "|---|---:|---:|---:|---:|",
        *rows,
    ])
    print(body)
    if args.write:
        write_section(args.write, "device_workers", body)


if __name__ == "__main__":
    main()
