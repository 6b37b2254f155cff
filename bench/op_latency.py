"""Per-op latency on neuron vs CPU eager, measured side by side in one run.

    python bench/op_latency.py [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from report import command_line, machine, time_interleaved, write_section  # noqa: E402

import torchneuron  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--write", help="update this markdown file's op_latency section")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()

    torch.manual_seed(0)
    small_c = torch.randn(16)
    small_n = small_c.to("neuron")
    big_c = torch.randn(1024, 1024)
    big_n = big_c.to("neuron")

    tiny = time_interleaved(
        {"cpu": lambda: small_c + small_c, "neuron": lambda: small_n + small_n},
        repeats=args.repeats, inner=200,
    )
    matmul = time_interleaved(
        {"cpu": lambda: big_c @ big_c, "neuron": lambda: big_n @ big_n},
        repeats=args.repeats, inner=3,
    )
    path = torchneuron.execution_stats()
    rows = [
        ("tiny op (add, 16 floats)", tiny["cpu"], tiny["neuron"]),
        ("matmul 1024x1024 fp32", matmul["cpu"], matmul["neuron"]),
    ]
    lines = [
        "## Per-op latency: neuron vs CPU eager",
        "",
        f"Command: `{command_line()}`  ",
        f"Machine: {machine()}  ",
        "Execution path: every op on the host fallback "
        f"({path['ops_on_host_fallback']} of {path['ops_dispatched']} ops dispatched).",
        "",
        "| case | CPU eager | neuron | neuron / CPU |",
        "|---|---:|---:|---:|",
    ]
    for name, c, n in rows:
        lines.append(f"| {name} | {_fmt(c)} | {_fmt(n)} | {n / c:.2f}x |")
    text = "\n".join(lines)
    print(text)
    if args.write:
        write_section(args.write, "op_latency", text)


def _fmt(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} µs" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


if __name__ == "__main__":
    main()
