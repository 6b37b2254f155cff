"""Shapes the library's kernels take: rows in blocks of at most 128 (a
tile's partition dimension) that divide the row count."""

from __future__ import annotations

import torch

from ..kernel.language import PMAX

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def row_block(rows: int, limit: int = PMAX) -> int:
    """The largest block of at most `limit` (<= PMAX) rows that divides `rows`."""
    for block in range(min(rows, limit, PMAX), 0, -1):
        if rows % block == 0:
            return block
    return 0


def on_device(*tensors) -> bool:
    """Whether a kernel takes these: float tensors on one neuron device, or
    on CPU (the simulator)."""
    devices = {t.device for t in tensors}
    return len(devices) == 1 and next(iter(devices)).type in ("neuron", "cpu") and all(
        t.dtype in _DTYPES for t in tensors)


def reference_autograd(reference, n_tensors: int) -> dict:
    """register_autograd's backward and setup_context for a library op:
    gradients of its PyTorch reference, recomputed from the saved inputs
    (neuron eager ops). Library kernels are forward kernels."""

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:n_tensors])
        ctx.attributes = inputs[n_tensors:]

    def backward(ctx, *grads):
        inputs = [t.detach().requires_grad_(need) for t, need in zip(ctx.saved_tensors, ctx.needs_input_grad)]
        with torch.enable_grad():
            outs = reference(*inputs, *ctx.attributes)
        outs = outs if isinstance(outs, tuple) else (outs,)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        wanted = [t for t in inputs if t.requires_grad]
        found = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
                     if pairs and wanted else [None] * len(wanted))
        return tuple(next(found) if t.requires_grad else None for t in inputs) + (None,) * len(ctx.attributes)

    return {"backward": backward, "setup_context": setup_context}


__all__ = ["on_device", "reference_autograd", "row_block"]
