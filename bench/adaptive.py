"""Adaptive eager mode against op mode and CPU eager, measured side by side.

    python bench/adaptive.py [--repeats 7] [--steps 30] [--write docs/benchmarks.md]

1. A loop of 1000 dependent tiny ops (adds of 16 floats) and one read.
2. A chain of 10 elementwise ops on a 1024x1024 tensor.
3. The demo training step (GPT, AdamW, dropout), steady state; peak memory.
4. Cold start with an empty cache, each mode in a fresh process: the first
   step, the time until every compile has landed and steps run at their
   steady speed, and the compile seconds the program waited for.

Steady figures are taken after `torchneuron.wait_for_compiles()`: every
graph met so far is fused. Each mode keeps its own fresh cache directory.
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
from report import command_line, machine, publish, time_interleaved  # noqa: E402

import torch  # noqa: E402

import torchneuron  # noqa: E402
from torchneuron.models import GPTConfig, train_gpt  # noqa: E402

MODES = ("op", "adaptive")


def _set(mode):
    return lambda: torchneuron.set_eager_mode(mode) if mode in MODES else None


def tiny_chain(x, n=1000):
    for _ in range(n):
        x = x + x
    return x.sum().item()  # one read


def elementwise_chain(x):
    y = x * 1.5
    y = y + 0.25
    y = torch.tanh(y)
    y = y * y
    y = y - 0.5
    y = torch.sigmoid(y)
    y = y * 3.0
    y = torch.exp(-y)
    y = y + x
    return torch.relu(y)


def _warm(fn, modes, inner):
    """Run fn in each neuron mode exactly as it will be timed (`inner` calls,
    each result held until the next call returns, then a sync) until
    adaptive's graphs are all compiled. Which results are still alive when a
    graph is cut is part of its identity, so a warm-up that drops results the
    timed loop holds would compile a different graph."""
    for mode in modes:
        torchneuron.set_eager_mode(mode)
        for _ in range(3):
            out = None
            for _ in range(inner):
                out = fn(mode)
            torch.neuron.synchronize()
            del out
            torchneuron.wait_for_compiles()


def steady_ops(repeats: int) -> dict:
    small = {"cpu": torch.full((16,), 1e-30)}
    big = {"cpu": torch.randn(1024, 1024)}
    for mode in MODES:
        small[mode] = small["cpu"].to("neuron")
        big[mode] = big["cpu"].to("neuron")
    _warm(lambda m: tiny_chain(small[m]), MODES, 1)
    _warm(lambda m: elementwise_chain(big[m]), MODES, 3)
    tiny = time_interleaved({m: (lambda m=m: tiny_chain(small[m])) for m in ("cpu",) + MODES},
                            repeats=repeats, inner=1, setup={m: _set(m) for m in MODES})
    chain = time_interleaved({m: (lambda m=m: elementwise_chain(big[m])) for m in ("cpu",) + MODES},
                             repeats=repeats, inner=3, setup={m: _set(m) for m in MODES})
    return {"tiny": tiny, "chain": chain}


def steady_step(steps: int, rounds: int) -> dict:
    cfg = GPTConfig()
    times = {m: [] for m in ("cpu",) + MODES}
    peaks = {}

    def run(mode, n):
        device = "cpu" if mode == "cpu" else "neuron"
        if mode != "cpu":
            torchneuron.set_eager_mode(mode)
        out = []
        last = [time.perf_counter()]

        def on_step(step, loss):
            now = time.perf_counter()
            out.append(now - last[0])
            last[0] = now

        last[0] = time.perf_counter()
        train_gpt(device, n, cfg=cfg, on_step=on_step)
        return out

    from torchneuron.adaptive import executor

    # Peak cuts are learned against the highest level op mode would have
    # reached since the last reset: the cases above reached far higher ones.
    torch.neuron.reset_peak_memory_stats()
    for mode in MODES:  # every graph of the loop compiled before timing
        # Builds that fail teach the recorder which ops to bake or leave out,
        # so the next steps can meet new graphs: warm until none appear.
        # So can op builds (an op whose scalars must be constants is built
        # again under new signatures).
        for _ in range(6):
            known = (executor.graph_count(), torchneuron.compile_stats()["signatures"])
            run(mode, 4)
            torchneuron.wait_for_compiles()
            if (executor.graph_count(), torchneuron.compile_stats()["signatures"]) == known:
                break
    for _ in range(rounds):
        for mode in times:
            t = run(mode, steps)
            times[mode].append(statistics.median(t[len(t) // 2:]))
    for mode in MODES:
        torchneuron.set_eager_mode(mode)
        torch.neuron.synchronize()
        torch.neuron.reset_peak_memory_stats()
        train_gpt("neuron", 3, cfg=cfg)
        torch.neuron.synchronize()
        peaks[mode] = torch.neuron.max_memory_allocated()
    return {"step": {m: statistics.median(v) for m, v in times.items()}, "peak": peaks}


def cold(mode: str, steps: int, wait: bool = True) -> dict:
    """One mode in this (fresh) process, with an empty cache."""
    if mode != "cpu":
        torchneuron.set_eager_mode(mode)
    device = "cpu" if mode == "cpu" else "neuron"
    start = time.perf_counter()
    stamps = []

    def on_step(step, loss):
        stamps.append(time.perf_counter())

    train_gpt(device, steps, cfg=GPTConfig(), on_step=on_step)
    if not wait:
        return {"first": stamps[0] - start}
    if device == "neuron":
        torchneuron.wait_for_compiles()
    landed = time.perf_counter() - start
    steps_t = [b - a for a, b in zip([start] + stamps, stamps)]
    stats = torchneuron.adaptive_stats()
    return {
        "first": steps_t[0],
        "landed": landed,
        "steady": statistics.median(steps_t[len(steps_t) // 2:]),
        "waited": (stats["compile_seconds_exposed"] if mode == "adaptive"
                   else torchneuron.execution_stats()["op_compile_seconds_waited"]),
        "compiles": torchneuron.compile_stats()["compiles"] if device == "neuron" else 0,
    }


def _cold_process(mode: str, *options) -> dict:
    env = dict(os.environ, TORCHNEURON_CACHE_DIR=tempfile.mkdtemp(prefix="tn-cold-"))
    proc = subprocess.run([sys.executable, __file__, "--cold", mode, *options], env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def cold_runs(steps: int, firsts: int) -> dict:
    """A whole cold run per mode; the first step alone again in `firsts`
    more fresh processes per mode, in turn (one process's first step swings
    by 2x with what the background threads happen to do then): median."""
    out = {mode: _cold_process(mode, "--steps", str(steps)) for mode in ("cpu",) + MODES}
    samples = {mode: [out[mode]["first"]] for mode in out}
    for _ in range(firsts):
        for mode in out:
            samples[mode].append(_cold_process(mode, "--steps", "1", "--first-only")["first"])
    for mode in out:
        out[mode]["first"] = statistics.median(samples[mode])
        out[mode]["first_range"] = (min(samples[mode]), max(samples[mode]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cold-steps", type=int, default=60)
    parser.add_argument("--cold-firsts", type=int, default=6, help="more fresh processes per mode for the first step")
    parser.add_argument("--cold", help=argparse.SUPPRESS)
    parser.add_argument("--first-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--write")
    args = parser.parse_args()
    if args.cold:
        print(json.dumps(cold(args.cold, args.steps, wait=not args.first_only)), flush=True)
        os._exit(0)  # (a first-only run leaves its background builds unfinished)
    ops = steady_ops(args.repeats)
    step = steady_step(args.steps, args.rounds)
    stats = torchneuron.adaptive_stats()
    starts = cold_runs(args.cold_steps, args.cold_firsts)
    tiny, chain, st = ops["tiny"], ops["chain"], step["step"]
    us = 1e6 / 1000  # the tiny loop: seconds per 1000 ops -> µs per op
    c = starts
    lines = [
        "## Adaptive eager mode: against op mode and CPU eager",
        "",
        f"Command: `{command_line()}`  ",
        f"Machine: {machine()}  ",
        f"Steady figures after every graph compiled (medians of {args.repeats} interleaved runs; the step: "
        f"{args.rounds} rounds of {args.steps} steps).",
        "",
        "| case | CPU eager | op mode | op / CPU | adaptive | adaptive / CPU |",
        "|---|---:|---:|---:|---:|---:|",
        f"| 1000 dependent tiny adds (16 floats) + one read, per op | {tiny['cpu'] * us:.2f} µs | "
        f"{tiny['op'] * us:.2f} µs | {tiny['op'] / tiny['cpu']:.2f}x | {tiny['adaptive'] * us:.2f} µs | "
        f"{tiny['adaptive'] / tiny['cpu']:.2f}x |",
        f"| chain of 10 elementwise ops, 1024x1024 | {chain['cpu'] * 1e3:.2f} ms | {chain['op'] * 1e3:.2f} ms | "
        f"{chain['op'] / chain['cpu']:.2f}x | {chain['adaptive'] * 1e3:.2f} ms | {chain['adaptive'] / chain['cpu']:.2f}x |",
        f"| demo training step (GPT, AdamW, dropout) | {st['cpu'] * 1e3:.1f} ms | {st['op'] * 1e3:.1f} ms | "
        f"{st['op'] / st['cpu']:.2f}x | {st['adaptive'] * 1e3:.1f} ms | {st['adaptive'] / st['cpu']:.2f}x |",
        "",
        f"Peak device memory of 3 demo steps: op mode {step['peak']['op'] / 2**20:.2f} MiB, adaptive "
        f"{step['peak']['adaptive'] / 2**20:.2f} MiB. Adaptive over this run: {stats['graphs_cut']} graphs cut, "
        f"{stats['ops_per_graph']} ops per graph, {stats['ops_fused']} of {stats['ops_recorded']} recorded ops run "
        f"fused, {stats['graphs_compiled']} graphs compiled whole and {stats['graphs_segmented']} in segments, "
        f"{stats['bytes_not_written'] / 2**20:.1f} MiB of dead results not written.",
        "",
        f"**Cold start** (empty cache, each in a fresh process, {args.cold_steps} demo steps; the first step: median "
        f"of {args.cold_firsts + 1} fresh processes per mode, range in brackets):",
        "",
        "| | CPU eager | op mode | adaptive |",
        "|---|---:|---:|---:|",
        f"| first step | {c['cpu']['first'] * 1e3:.0f} ms ({c['cpu']['first_range'][0] * 1e3:.0f}-"
        f"{c['cpu']['first_range'][1] * 1e3:.0f}) | {c['op']['first']:.2f} s ({c['op']['first_range'][0]:.2f}-"
        f"{c['op']['first_range'][1]:.2f}) | {c['adaptive']['first']:.2f} s ({c['adaptive']['first_range'][0]:.2f}-"
        f"{c['adaptive']['first_range'][1]:.2f}) |",
        f"| first step / CPU's first step | 1x | {c['op']['first'] / c['cpu']['first']:.1f}x | "
        f"{c['adaptive']['first'] / c['cpu']['first']:.1f}x |",
        f"| until every compile landed | - | {c['op']['landed']:.1f} s | {c['adaptive']['landed']:.1f} s |",
        f"| compile seconds the program waited for | - | {c['op']['waited']:.1f} s ({c['op']['compiles']} compiles) | "
        f"{c['adaptive']['waited']:.1f} s ({c['adaptive']['compiles']} compiles) |",
        f"| steady step (second half) | {c['cpu']['steady'] * 1e3:.1f} ms | {c['op']['steady'] * 1e3:.1f} ms | "
        f"{c['adaptive']['steady'] * 1e3:.1f} ms |",
    ]
    publish(lines, args.write, "adaptive")


if __name__ == "__main__":
    main()
