"""Shared helpers for benchmarks: interleaved timing and writing a section of
docs/benchmarks.md (each benchmark owns one section, marked by its name)."""

from __future__ import annotations

import platform
import re
import statistics
import sys
import time
from pathlib import Path

import torch


def time_interleaved(cases: dict, repeats: int, inner: int, warmup: int = 3, setup: dict | None = None) -> dict:
    """Median seconds per call of each case, timing the cases in turn so that
    machine noise hits them alike. Each case is a zero-argument callable that
    returns something to synchronize on (or None); setup[name], if given, runs
    untimed before each of its case's timed blocks (a mode switch)."""
    setup = setup or {}
    for name, fn in cases.items():
        setup.get(name, _nothing)()
        for _ in range(warmup):
            _sync(fn())
    samples = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            setup.get(name, _nothing)()
            start = time.perf_counter()
            for _ in range(inner):
                out = fn()
            _sync(out)
            samples[name].append((time.perf_counter() - start) / inner)
    return {name: statistics.median(s) for name, s in samples.items()}


def _nothing() -> None:
    pass


def _sync(out) -> None:
    if isinstance(out, torch.Tensor) and out.device.type == "neuron":
        torch.neuron.synchronize(out.device.index)


def machine() -> str:
    """The machine, with the CPU the executables were compiled for and its
    vector features: they change the figures (AVX-512 vs AVX2 alone)."""
    from torchneuron.compiler import target_cpu

    cpu = target_cpu.configured()
    vector = [f for f in cpu.vector_features() if f.startswith(("avx", "amx"))]
    widest = "AVX-512" if cpu.has("avx512f") else "AVX2" if cpu.has("avx2") else "no AVX2"
    return (
        f"{platform.machine()}, CPU {cpu.name}, {widest} ({' '.join(vector) or '-'}), "
        f"{torch.get_num_threads()} threads, Python {platform.python_version()}, torch {torch.__version__}"
    )


def write_section(path: str, name: str, body: str) -> None:
    """Replace (or append) the section between <!-- bench:name --> markers."""
    p = Path(path)
    text = p.read_text() if p.exists() else "# Benchmarks\n\nFigures are medians of interleaved runs on a shared, noisy machine: read the ratios.\n"
    begin, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    block = f"{begin}\n{body.rstrip()}\n{end}"
    if begin in text:
        text = re.sub(re.escape(begin) + r".*?" + re.escape(end), lambda _: block, text, flags=re.S)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    p.write_text(text)


def publish(lines: list, path: str | None, name: str) -> None:
    """Print a benchmark's report and, where `path` is given (--write), put it
    in the section `name` of that file."""
    text = "\n".join(lines)
    print(text)
    if path:
        write_section(path, name, text)


def command_line() -> str:
    return "python " + " ".join(sys.argv)


def train_step_times(device: str, steps: int, **train_kwargs) -> list:
    """Seconds each of `steps` steps of the demo GPT's training took
    (torchneuron.models.train_gpt with these arguments)."""
    from torchneuron.models import train_gpt

    times, last = [], [time.perf_counter()]

    def on_step(step, loss):
        now = time.perf_counter()
        times.append(now - last[0])
        last[0] = now

    last[0] = time.perf_counter()
    train_gpt(device, steps, on_step=on_step, **train_kwargs)
    return times
