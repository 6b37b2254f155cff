"""Long sums, matrix products and convolutions on neuron vs CPU eager: time,
and each one's distance from the float64 answer, side by side in one run
(lowering/rules/long_sums.py, split_k.py, long_convolutions.py, convolution_products.py,
convolution_backward.py), the backward of bilinear upsampling
(interpolation_backward.py; before it, the host path: CPU's kernel), and
float32 sin, cos and tan (trigonometry.py), atan, atan2, asin, pow, exp2
(double_evaluation.py), lgamma, erfc and erfinv (special.py), and ops given
CPU's semantics: fmod and floor division (float_division.py), clamp, maximum,
argmax, topk and sort (nan_propagation.py).

    python bench/long_reductions.py [--repeats 7] [--only conv] [--write docs/benchmarks.md]

"first call" is the first neuron call's time with an empty cache (its compile).
Each case runs as a compiled op (op mode, waiting for its compile). Run it
with PYTHONPATH pointing at an older checkout (and --section) to measure that
checkout's lowering with the same script.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TORCHNEURON_CACHE_DIR", tempfile.mkdtemp(prefix="tn-bench-"))
from report import command_line, machine, time_interleaved, write_section  # noqa: E402

import torch  # noqa: E402

import torchneuron  # noqa: E402

torchneuron.set_eager_mode("op")
torchneuron.config.set(compile_wait=True)

F = torch.nn.functional


def _conv_backward(stride, padding, mask, part):
    def backward(grad, x, weight):
        return torch.ops.aten.convolution_backward(grad, x, weight, [weight.shape[0]], stride, padding,
                                                   [1] * len(stride), False, [0] * len(stride), 1, mask)[part]

    return backward


def _upsample_backward(output_size, input_size, align_corners=False):
    def backward(grad):
        return torch.ops.aten.upsample_bilinear2d_backward(grad, output_size, input_size, align_corners)

    return backward


CASES = [  # (name, function, input shapes)
    ("row sums [32, 65536]", lambda x: x.sum(-1), [(32, 65536)]),
    ("sum of 1M elements", lambda x: x.sum(), [(1 << 20,)]),
    ("column sums [16485, 64]", lambda x: x.sum(0), [(16485, 64)]),
    ("vector_norm of 1M elements", lambda x: torch.linalg.vector_norm(x), [(1 << 20,)]),
    ("bias gradient: sum over [8, 512, 768] dims 0, 1", lambda x: x.sum((0, 1)), [(8, 512, 768)]),
    ("mm [16, 8192] @ [8192, 32]", torch.mm, [(16, 8192), (8192, 32)]),
    ("mm [64, 3145] @ [3145, 64]", torch.mm, [(64, 3145), (3145, 64)]),
    ("mm [256, 2048] @ [2048, 256]", torch.mm, [(256, 2048), (2048, 256)]),
    ("mm [512, 8192] @ [8192, 512]", torch.mm, [(512, 8192), (8192, 512)]),
    ("mm [1024, 4096] @ [4096, 1024] (left whole)", torch.mm, [(1024, 4096), (4096, 1024)]),
    ("bmm [4, 16, 3145] @ [4, 3145, 3145]", torch.bmm, [(4, 16, 3145), (4, 3145, 3145)]),
    ("conv1d [2, 256, 320] * [256, 256, 11], dilation 3 (vits)",
     lambda x, w: F.conv1d(x, w, padding=15, dilation=3), [(2, 256, 320), (256, 256, 11)]),
    ("conv2d [2, 512, 20, 20] * [512, 512, 3, 3] (textnet)",
     lambda x, w: F.conv2d(x, w, padding=1), [(2, 512, 20, 20), (512, 512, 3, 3)]),
    ("conv2d [2, 3328, 4, 16] * [1024, 3328, 1, 1] (pp_ocrv5)", F.conv2d, [(2, 3328, 4, 16), (1024, 3328, 1, 1)]),
    ("conv1d [8, 512, 200] * [512, 512, 3]", lambda x, w: F.conv1d(x, w, padding=1), [(8, 512, 200), (512, 512, 3)]),
    ("conv2d [8, 256, 56, 56] * [64, 256, 1, 1]", F.conv2d, [(8, 256, 56, 56), (64, 256, 1, 1)]),
    ("conv2d [8, 64, 56, 56] * [64, 64, 3, 3] (left whole)",
     lambda x, w: F.conv2d(x, w, padding=1), [(8, 64, 56, 56), (64, 64, 3, 3)]),
    ("conv backward, weight of [128, 64, 1, 3] over 2x80x80 (textnet)",
     _conv_backward([2, 2], [0, 1], [False, True, False], 1), [(2, 128, 80, 80), (2, 64, 160, 160), (128, 64, 1, 3)]),
    ("conv backward, input of [1536, 32, 3] (fastspeech2)",
     _conv_backward([1], [1], [True, False, False], 0), [(2, 1536, 11), (2, 32, 11), (1536, 32, 3)]),
    ("conv backward, all of [64, 64, 3, 3] over 8x56x56 (weight's error)",
     _conv_backward([1, 1], [1, 1], [True, True, True], 1), [(8, 64, 56, 56), (8, 64, 56, 56), (64, 64, 3, 3)]),
    ("upsample_bilinear2d backward, [2, 256, 32, 32] from 64x64 (a feature pyramid's)",
     _upsample_backward([64, 64], [2, 256, 32, 32]), [(2, 256, 64, 64)]),
    ("upsample_bilinear2d backward, [2, 64, 80, 80] from 160x160",
     _upsample_backward([160, 160], [2, 64, 80, 80]), [(2, 64, 160, 160)]),
    ("upsample_bilinear2d backward, [8, 3, 32, 32] from 224x224, corners aligned",
     _upsample_backward([224, 224], [8, 3, 32, 32], True), [(8, 3, 224, 224)]),
    ("trig: sin of 1M elements, standard normal", torch.sin, [(1 << 20,)]),
    ("trig: cos of 1M elements, x 1000 (rotary angles)", lambda x: torch.cos(x * 1000), [(1 << 20,)]),
    ("trig: tan of 1M elements, x 3", lambda x: torch.tan(x * 3), [(1 << 20,)]),
    ("float64 evaluation: atan of 1M elements, x 10", lambda x: torch.atan(x * 10), [(1 << 20,)]),
    ("float64 evaluation: atan2 of 1M elements", torch.atan2, [(1 << 20,), (1 << 20,)]),
    ("float64 evaluation: asin of 1M elements, x / 8 clamped to [-1, 1]",
     lambda x: torch.asin((x / 8).clamp(-1, 1)), [(1 << 20,)]),
    ("float64 evaluation: pow of 1M elements, |x| + 0.1 by y * 4", lambda x, y: torch.pow(x.abs() + 0.1, y * 4),
     [(1 << 20,), (1 << 20,)]),
    ("float64 evaluation: pow of 1M elements, (|x| + 0.1) ** -1.5", lambda x: torch.pow(x.abs() + 0.1, -1.5),
     [(1 << 20,)]),
    ("special functions in float64: lgamma of 1M elements, |x| * 3 + 0.01", lambda x: torch.lgamma(x.abs() * 3 + 0.01),
     [(1 << 20,)]),
    ("special functions in float64: erfc of 1M elements, x * 3", lambda x: torch.erfc(x * 3), [(1 << 20,)]),
    ("special functions in float64: erfinv of 1M elements, tanh(x)", lambda x: torch.erfinv(torch.tanh(x)),
     [(1 << 20,)]),
    ("special functions in float64: exp2 of 1M elements, x * 20", lambda x: torch.exp2(x * 20), [(1 << 20,)]),
    ("CPU semantics: fmod of 1M elements, x * 100 by |y| + 0.5",
     lambda x, y: torch.fmod(x * 100, y.abs() + 0.5), [(1 << 20,), (1 << 20,)]),
    ("CPU semantics: floor division of 1M elements, x * 100 by |y| + 0.5",
     lambda x, y: torch.div(x * 100, y.abs() + 0.5, rounding_mode="floor"), [(1 << 20,), (1 << 20,)]),
    ("CPU semantics: clamp of 1M elements to [-1, 1]", lambda x: x.clamp(-1, 1), [(1 << 20,)]),
    ("CPU semantics: maximum of 1M element pairs", torch.maximum, [(1 << 20,), (1 << 20,)]),
    ("CPU semantics: argmax over [32, 50257] (an LM head's logits)", lambda x: x.argmax(-1), [(32, 50257)]),
    ("CPU semantics: topk 50 over [32, 50257]", lambda x: torch.topk(x, 50).values, [(32, 50257)]),
    ("CPU semantics: sort of [64, 4096]", lambda x: torch.sort(x).values, [(64, 4096)]),
]


def _error(got, exact) -> float:
    return (got.double() - exact.double()).abs().mean().item()


def _ratio(mine: float, cpus: float) -> str:
    if cpus == 0:
        return "exact" if mine == 0 else "CPU exact"
    return f"{mine / cpus:.2f}x"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--write", help="update this markdown file's section")
    parser.add_argument("--section", default="long_reductions")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--only", help="the cases whose name holds this text")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, fn, shapes in CASES:
        if args.only and args.only not in name:
            continue
        xs = [torch.randn(s, generator=gen) for s in shapes]
        xn = [x.to("neuron") for x in xs]
        start = time.perf_counter()
        fn(*xn).cpu()
        first = time.perf_counter() - start
        t = time_interleaved({"cpu": lambda: fn(*xs), "neuron": lambda: fn(*xn)}, repeats=args.repeats, inner=1)
        exact = fn(*[x.double() for x in xs])
        errors = _error(fn(*xn).cpu(), exact), _error(fn(*xs), exact)
        rows.append((name, t, errors, first))
        print(f"{name}: first call {first:.1f} s; neuron {t['neuron'] * 1e3:.3f} ms, CPU {t['cpu'] * 1e3:.3f} ms "
              f"({t['neuron'] / t['cpu']:.2f}x); error from float64 {errors[0]:.2e} vs CPU {errors[1]:.2e} "
              f"({_ratio(*errors)})", flush=True)
    lines = [
        f"## Long sums, products and convolutions ({args.section})", "",
        f"Command: `{command_line()}`  ", f"Machine: {machine()}", "",
        "Op mode, compiled; error: mean absolute distance from the float64 answer (inputs standard normal).", "",
        "| case | first call s | neuron ms | CPU ms | time ratio | neuron error | CPU error | error ratio |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, t, (mine, cpus), first in rows:
        lines.append(f"| {name} | {first:.1f} | {t['neuron'] * 1e3:.3f} | {t['cpu'] * 1e3:.3f} | {t['neuron'] / t['cpu']:.2f}x "
                     f"| {mine:.2e} | {cpus:.2e} | {_ratio(mine, cpus)} |")
    print("\n".join(lines))
    if args.write:
        write_section(args.write, args.section, "\n".join(lines))


if __name__ == "__main__":
    main()
