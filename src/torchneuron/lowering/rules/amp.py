"""GradScaler's two kernels, as ops the lowering compiles, so unscaling and
the scale update run on the device (PyTorch has CPU and CUDA kernels only).
The export functionalizes the in-place forms into these functional ones."""

from __future__ import annotations

import torch

aten = torch.ops.aten


def non_finite_check_and_unscale(grads, found_inf, inv_scale):
    """Multiply every gradient by inv_scale; found_inf becomes 1 if any holds
    an inf or NaN (as CUDA's kernel: unscaled in float32, stored in the
    gradient's dtype)."""
    found = found_inf
    unscaled = []
    for g in grads:
        bad = torch.logical_not(torch.isfinite(g)).any().to(found.dtype)
        found = torch.maximum(found, bad)
        unscaled.append((g.to(torch.float32) * inv_scale).to(g.dtype))
    return unscaled, found


def update_scale(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval):
    """CUDA's _amp_update_scale_: back off after an inf, grow after
    growth_interval clean steps (unless the grown scale overflows)."""
    found = found_inf > 0
    # Counted in float32 (exact up to 2**24 steps): torch-mlir fails on
    # arithmetic on a 0-d int32 tensor.
    successful = growth_tracker.to(torch.float32) + 1
    grow = torch.logical_and(torch.logical_not(found), successful == growth_interval)
    grown = scale * growth_factor
    new_scale = torch.where(
        found, scale * backoff_factor, torch.where(torch.logical_and(grow, torch.isfinite(grown)), grown, scale)
    )
    new_tracker = torch.where(torch.logical_or(found, grow), torch.zeros_like(successful), successful)
    return new_scale, new_tracker.to(growth_tracker.dtype)


def decompositions() -> dict:
    return {
        aten._amp_foreach_non_finite_check_and_unscale.default: non_finite_check_and_unscale,
        aten._amp_update_scale.default: update_scale,
    }
