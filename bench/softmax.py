"""Softmax on neuron vs CPU eager at row counts IREE's tiling handled badly
(lowering/rules/softmax_rows.py), measured side by side in one run.

    python bench/softmax.py [--repeats 7] [--write docs/benchmarks.md]

Each case runs as a compiled op (op mode, waiting for its compile) and, for
attention, as one torch.compile graph. Run it with PYTHONPATH pointing at an
older checkout to measure that checkout's lowering with the same script.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TORCHNEURON_CACHE_DIR", tempfile.mkdtemp(prefix="tn-bench-"))
from report import command_line, machine, publish, time_interleaved  # noqa: E402

import torch  # noqa: E402

import torchneuron  # noqa: E402

torchneuron.set_eager_mode("op")
torchneuron.config.set(compile_wait=True)

CASES = [  # (name, shape); softmax over the last dimension
    ("softmax [3000, 2992] (3000 rows)", (3000, 2992)),
    ("softmax [2047, 2048] (odd rows)", (2047, 2048)),
    ("softmax [2046, 2048] (2 x odd rows)", (2046, 2048)),
    ("softmax [2048, 2048] (power of two)", (2048, 2048)),
    ("softmax [2, 3, 1000, 1000] (attention scores)", (2, 3, 1000, 1000)),
    ("log_softmax [3000, 512]", (3000, 512)),
]


def attention(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) * 0.125, -1) @ v


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--write", help="update this markdown file's softmax section")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for name, shape in CASES:
        fn = torch.log_softmax if name.startswith("log_") else torch.softmax
        x = torch.randn(shape)
        xn = x.to("neuron")
        t = time_interleaved({"cpu": lambda: fn(x, -1), "neuron": lambda: fn(xn, -1)}, repeats=args.repeats, inner=1)
        torch.testing.assert_close(fn(xn, -1).cpu(), fn(x, -1))
        rows.append((name, t))
    compiled = torch.compile(attention, backend="neuron")
    qkv = [torch.randn(2, 3, 1000, 64) for _ in range(3)]
    qkv_n = [t.to("neuron") for t in qkv]
    t = time_interleaved({"cpu": lambda: attention(*qkv), "neuron": lambda: compiled(*qkv_n)}, repeats=args.repeats, inner=1)
    torch.testing.assert_close(compiled(*qkv_n).cpu(), attention(*qkv), rtol=1e-4, atol=1e-5)
    rows.append(("attention [2, 3, 1000, 64], torch.compile graph (CPU: eager)", t))

    lines = [
        "## Softmax rows: neuron vs CPU eager",
        "",
        f"Command: `{command_line()}`  ",
        f"Machine: {machine()}  ",
        "Medians of interleaved runs; neuron: the compiled op (op mode) or graph, timed to completion.",
        "",
        "| case | CPU eager | neuron | neuron / CPU |",
        "|---|---:|---:|---:|",
    ]
    for name, t in rows:
        lines.append(f"| {name} | {t['cpu'] * 1e3:.2f} ms | {t['neuron'] * 1e3:.2f} ms | {t['neuron'] / t['cpu']:.2f}x |")
    publish(lines, args.write, "softmax")


if __name__ == "__main__":
    main()
