"""torch.compile(backend="neuron") against Inductor on CPU and CPU eager:
the demo GPT's training step (model compiled, optimizer eager in every
mode), measured side by side.

    python bench/compile.py [--steps 30] [--rounds 3] [--write docs/benchmarks.md]

1. Steady step: median step time after warm-up, rounds interleaved.
2. Cold start, each mode in a fresh process with empty caches (neuron's
   cache directory, Inductor's): the first step, which holds every compile;
   neuron also with the optimizer's eager ops in adaptive mode.
   Steady also with the optimizer's eager ops in adaptive mode.
3. Restart: neuron again in a fresh process on the cache the cold run left:
   its first step, and how many executables it compiled (goal: none).
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
from report import command_line, machine, publish  # noqa: E402

MODES = {"cpu": ("cpu", None), "inductor": ("cpu", "inductor"), "neuron": ("neuron", "neuron")}


def run_steps(mode: str, steps: int) -> dict:
    """Train `steps` steps in this process; step times and compile counts."""
    import torch  # noqa: F401

    import torchneuron
    from torchneuron.models import train_gpt

    device, backend = MODES[mode]
    stamps = []
    start = time.perf_counter()
    train_gpt(device, steps, compile_backend=backend, on_step=lambda step, loss: stamps.append(time.perf_counter()))
    times = [b - a for a, b in zip([start] + stamps, stamps)]
    landed = None
    if device == "neuron":  # eager ops' builds land (in the cache) before the process ends
        torchneuron.wait_for_compiles()
        landed = time.perf_counter() - start
    stats = torchneuron.compile_stats()
    return {
        "first": times[0],
        "steady": statistics.median(times[len(times) // 2:]),
        "compiled": stats["sources"].get("compiled", 0) if device == "neuron" else None,
        "graphs": stats["dynamo"],
        "landed": landed,
    }


def fresh_process(mode: str, steps: int, env: dict) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", mode, "--steps", str(steps)],
                          env=env, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--write")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_steps(args.child, args.steps)))
        return
    neuron_cache = tempfile.mkdtemp(prefix="tn-compile-bench-")
    cold = {}
    for mode in MODES:
        env = dict(os.environ, TORCHNEURON_CACHE_DIR=neuron_cache,
                   TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="inductor-bench-"))
        cold[mode] = fresh_process(mode, args.steps, env)
    # The optimizer's eager ops in adaptive mode: their compiles run in the
    # background instead of in line (a separate empty cache).
    cold_adaptive = fresh_process("neuron", args.steps, dict(
        os.environ, TORCHNEURON_CACHE_DIR=tempfile.mkdtemp(prefix="tn-compile-bench-"),
        TORCHNEURON_EAGER_MODE="adaptive"))
    restart = fresh_process("neuron", args.steps, dict(os.environ, TORCHNEURON_CACHE_DIR=neuron_cache))
    # Steady figures: rounds of each mode in turn, each in a warm process;
    # neuron also with the optimizer's eager ops in adaptive mode.
    steady = {mode: [] for mode in (*MODES, "neuron_adaptive")}
    adaptive_env = dict(os.environ, TORCHNEURON_CACHE_DIR=neuron_cache, TORCHNEURON_EAGER_MODE="adaptive")
    fresh_process("neuron", args.steps, adaptive_env)  # its fused graphs built and cached first
    for _ in range(args.rounds):
        for mode in steady:
            env = dict(os.environ, TORCHNEURON_CACHE_DIR=neuron_cache)
            if mode == "neuron_adaptive":
                env["TORCHNEURON_EAGER_MODE"] = "adaptive"
            steady[mode].append(fresh_process(mode.split("_")[0], args.steps, env)["steady"])
    step = {mode: statistics.median(v) for mode, v in steady.items()}
    ms = 1e3
    lines = [
        "## torch.compile: backend=\"neuron\" against Inductor and CPU eager",
        "",
        f"Command: `{command_line()}`  ",
        f"Machine: {machine()}  ",
        f"The demo GPT's training step, the model compiled and AdamW eager in every mode; steady: median of "
        f"the later half of {args.steps} steps, median of {args.rounds} rounds, modes in turn.",
        "",
        "| | CPU eager | Inductor (CPU) | neuron | neuron / Inductor | neuron, adaptive eager | "
        "that / Inductor |",
        "|---|---:|---:|---:|---:|---:|---:|",
        f"| steady step | {step['cpu'] * ms:.1f} ms | {step['inductor'] * ms:.1f} ms | {step['neuron'] * ms:.1f} ms | "
        f"{step['neuron'] / step['inductor']:.2f}x | {step['neuron_adaptive'] * ms:.1f} ms | "
        f"{step['neuron_adaptive'] / step['inductor']:.2f}x |",
        f"| cold first step (empty caches) | {cold['cpu']['first']:.2f} s | {cold['inductor']['first']:.2f} s | "
        f"{cold['neuron']['first']:.1f} s | {cold['neuron']['first'] / cold['inductor']['first']:.2f}x | "
        f"{cold_adaptive['first']:.1f} s | {cold_adaptive['first'] / cold['inductor']['first']:.2f}x |",
        f"| restarted process, first step | | | {restart['first']:.2f} s | | | |",
        "",
        "Neuron, adaptive eager: the same compiled model, AdamW's and clipping's eager ops in adaptive "
        "mode (`TORCHNEURON_EAGER_MODE=adaptive`: recorded into fused graphs, compiled in the background).",
        "",
        f"Every compile of the cold neuron run had landed {cold['neuron']['landed']:.1f} s after its first "
        f"step began (adaptive parts: {cold_adaptive['landed']:.1f} s).",
        "",
        f"Executables compiled: cold {cold['neuron']['compiled']}, restarted process {restart['compiled']} "
        f"(goal: 0). Graphs: {json.dumps(cold['neuron']['graphs'])}.",
    ]
    publish(lines, args.write, "compile")


if __name__ == "__main__":
    main()
