"""The kernel library against the same computation as eager neuron ops (its
PyTorch reference on neuron tensors, op mode) and PyTorch CPU eager,
measured side by side.

    python bench/kernels.py [--repeats 7] [--write docs/benchmarks.md]

Paged attention (vLLM's attention on neuron) is timed at a decode and a
prefill step. Flash attention also reports peak device memory of one call against the
eager composite (scaled_dot_product_attention's math on neuron), whose
scores grow with the square of the sequence.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TORCHNEURON_CACHE_DIR", tempfile.mkdtemp(prefix="tn-bench-kernels-"))
from report import command_line, machine, time_interleaved, write_section  # noqa: E402

import torch  # noqa: E402

import torchneuron  # noqa: E402,F401
from torchneuron import kernels as K  # noqa: E402


def forward_backward(attention):
    """Attention's forward and backward (the gradient of sum(out * g))."""
    def run(q, k, v, **kwargs):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = attention(q, k, v, **kwargs)
        out.backward(torch.ones_like(out))
        return q.grad
    return run


def cases():
    torch.manual_seed(0)
    x, r, w = torch.randn(4096, 1024), torch.randn(4096, 1024), torch.randn(1024)
    logits, target = torch.randn(256, 32000), torch.randint(0, 32000, (256,))
    q, k, v = (torch.randn(1, 4, 2048, 64) for _ in range(3))
    tokens, probs = torch.randn(512, 128), torch.softmax(torch.randn(512, 8), -1)
    w1, w2 = torch.randn(8, 128, 512) * 0.05, torch.randn(8, 512, 128) * 0.05
    return {
        "rms_norm 4096x1024": (K.rms_norm, K.rms_norm_reference, (x, w), {}),
        "add_rms_norm 4096x1024": (K.add_rms_norm, K.add_rms_norm_reference, (x, r, w), {}),
        "softmax 4096x1024": (K.softmax, K.softmax_reference, (x,), {}),
        "swiglu 4096x1024": (K.swiglu, K.swiglu_reference, (x, r), {}),
        "cross_entropy 256x32000": (K.cross_entropy, K.cross_entropy_reference, (logits, target), {}),
        "flash_attention causal 4 heads x 2048 x 64": (K.flash_attention, K.flash_attention_reference, (q, k, v),
                                                       {"causal": True}),
        "flash_attention causal forward + backward, 4 heads x 2048 x 64": (
            forward_backward(K.flash_attention), forward_backward(K.flash_attention_reference), (q, k, v),
            {"causal": True}),
        "moe 512 tokens, 8 experts, top 2, 128 -> 512 -> 128": (K.moe, K.moe_reference, (tokens, probs, w1, w2), {}),
        **_paged_cases(),
    }


def _paged_cases() -> dict:
    """vLLM's attention steps on a paged cache of 16-token blocks: 16 requests, 8 query heads on 2 KV
    heads of 64; decode (one query each) over 256-token contexts, and a prefill of 64 tokens each."""
    requests, blocks = 16, 16
    cache = torch.randn((requests * blocks + 1) * 16, 2, 128)
    table = torch.randperm(requests * blocks, dtype=torch.int32).add(1).reshape(requests, blocks)
    lengths = lambda n: torch.full((requests,), n, dtype=torch.int32)  # noqa: E731
    decode = (torch.randn(requests, 8, 1, 64), cache, table, lengths(250), lengths(1))
    prefill = (torch.randn(requests, 8, 64, 64), cache, table[:, :4], lengths(64), lengths(64))
    return {
        "paged_attention decode, 16 requests x 8 heads (2 KV) x 256 context": (
            K.paged_attention, K.paged_attention_reference, decode, {}),
        "paged_attention prefill, 16 requests x 8 heads (2 KV) x 64 tokens": (
            K.paged_attention, K.paged_attention_reference, prefill, {}),
    }


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def peak(fn) -> int:
    torch.neuron.synchronize()
    torch.neuron.reset_peak_memory_stats()
    base = torch.neuron.memory_allocated()
    _first(fn()).cpu()
    return torch.neuron.max_memory_allocated() - base


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--write")
    args = parser.parse_args()
    rows, memory = [], {}
    for name, (kernel, reference, inputs, kwargs) in cases().items():
        neuron = [t.to("neuron") for t in inputs]
        timed = time_interleaved({
            "cpu": lambda: _first(reference(*inputs, **kwargs)),
            "eager": lambda: _first(reference(*neuron, **kwargs)),
            "kernel": lambda: _first(kernel(*neuron, **kwargs)),
        }, repeats=args.repeats, inner=3)
        rows.append((name, timed))
        if name.startswith("flash_attention causal 4"):
            memory = {"kernel": peak(lambda: kernel(*neuron, **kwargs)),
                      "eager": peak(lambda: reference(*neuron, **kwargs))}
        print(name, {k: f"{v * 1e3:.2f} ms" for k, v in timed.items()}, flush=True)
    lines = [
        "## Kernel library: kernels against eager neuron ops and CPU eager",
        "",
        f"Command: `{command_line()}`  ",
        f"Machine: {machine()}  ",
        "Each kernel against its PyTorch reference run as eager neuron ops (op mode, cached executables) and on "
        f"CPU; medians of {args.repeats} interleaved rounds of 3 calls, each timed to completion.",
        "",
        "| computation | CPU eager | eager neuron ops | kernel | kernel / eager neuron | kernel / CPU |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, t in rows:
        lines.append(f"| {name} | {t['cpu'] * 1e3:.2f} ms | {t['eager'] * 1e3:.2f} ms | {t['kernel'] * 1e3:.2f} ms | "
                     f"{t['kernel'] / t['eager']:.2f}x | {t['kernel'] / t['cpu']:.2f}x |")
    if memory:
        lines += ["", f"Flash attention's peak device memory in one call: kernel {memory['kernel'] / 2**20:.1f} MiB, "
                      f"eager composite {memory['eager'] / 2**20:.1f} MiB (the output alone: "
                      f"{4 * 2048 * 64 * 4 / 2**20:.1f} MiB)."]
    body = "\n".join(lines)
    print(body)
    if args.write:
        write_section(args.write, "kernels", body)


if __name__ == "__main__":
    main()
