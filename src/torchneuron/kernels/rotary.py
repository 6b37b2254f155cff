"""Rotary position embedding in the rotate-half convention (Llama's):
x * cos + rotate_half(x) * sin, with cos and sin over the whole head dim."""

from __future__ import annotations

import torch

from .. import kernel as nk
from ._blocks import on_device, reference_autograd, row_block


@nk.jit
def _rotary(x, cos, sin, out, ROWS: nk.constexpr):
    rows = nk.ds(nk.program_id(0) * ROWS, ROWS)
    half = x.shape[1] // 2
    t = nk.cast(nk.load(x[rows, :]), nk.float32)
    rotated = nk.ndarray((ROWS, x.shape[1]), nk.float32)
    rotated[:, 0:half] = -t[:, half:x.shape[1]]
    rotated[:, half:x.shape[1]] = t[:, 0:half]
    c = nk.cast(nk.load(cos[rows, :]), nk.float32)
    s = nk.cast(nk.load(sin[rows, :]), nk.float32)
    nk.store(out[rows, :], nk.cast(t * c + rotated * s, out.dtype))


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_reference(x, cos, sin):
    return (x.float() * cos.float() + _rotate_half(x.float()) * sin.float()).to(x.dtype)


_rotary_op = nk.op(
    "neuron_kernels::rotary", _rotary, outputs=lambda x, cos, sin: [(x.shape, x.dtype)],
    grid=lambda x, cos, sin: (x.shape[0] // row_block(x.shape[0]),),
    constants=lambda x, cos, sin: {"ROWS": row_block(x.shape[0])},
    **reference_autograd(rotary_reference, 3))


def rotary(x, cos, sin):
    """x * cos + rotate_half(x) * sin; cos and sin broadcast to x."""
    if x.dim() == 0 or x.shape[-1] % 2 or not on_device(x, cos, sin):
        return rotary_reference(x, cos, sin)
    rows = x.reshape(-1, x.shape[-1])
    if not row_block(rows.shape[0]):
        return rotary_reference(x, cos, sin)
    cos, sin = (c.expand(x.shape).reshape(rows.shape) for c in (cos, sin))
    return _rotary_op(rows, cos, sin).view(x.shape)


__all__ = ["rotary", "rotary_reference"]
