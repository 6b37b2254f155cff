"""RMSNorm, and RMSNorm with the residual add fused in front (the pair every
pre-norm transformer block runs)."""

from __future__ import annotations

import torch

from .. import kernel as nk
from ._blocks import on_device, reference_autograd, row_block


@nk.jit
def _rms_norm(x, w, out, ROWS: nk.constexpr, EPS: nk.constexpr):
    rows = nk.ds(nk.program_id(0) * ROWS, ROWS)
    t = nk.cast(nk.load(x[rows, :]), nk.float32)
    inv = nk.rsqrt(nk.sum(t * t, axis=1, keepdims=True) / x.shape[1] + EPS)
    nk.store(out[rows, :], nk.cast(t * inv * nk.cast(nk.load(w[0:1, :]), nk.float32), out.dtype))


@nk.jit
def _add_rms_norm(x, r, w, out, residual, ROWS: nk.constexpr, EPS: nk.constexpr):
    rows = nk.ds(nk.program_id(0) * ROWS, ROWS)
    h = nk.cast(nk.load(x[rows, :]), nk.float32) + nk.cast(nk.load(r[rows, :]), nk.float32)
    nk.store(residual[rows, :], nk.cast(h, residual.dtype))
    inv = nk.rsqrt(nk.sum(h * h, axis=1, keepdims=True) / x.shape[1] + EPS)
    nk.store(out[rows, :], nk.cast(h * inv * nk.cast(nk.load(w[0:1, :]), nk.float32), out.dtype))


def rms_norm_reference(x, weight, eps=1e-6):
    t = x.float()
    return (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def add_rms_norm_reference(x, residual, weight, eps=1e-6):
    h = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_reference(h.float(), weight, eps).to(x.dtype), h


_rms_norm_op = nk.op(
    "neuron_kernels::rms_norm", _rms_norm, attributes={"eps": "float"},
    outputs=lambda x, w, eps: [(x.shape, x.dtype)],
    grid=lambda x, w, eps: (x.shape[0] // row_block(x.shape[0]),),
    constants=lambda x, w, eps: {"ROWS": row_block(x.shape[0]), "EPS": eps},
    **reference_autograd(rms_norm_reference, 2))

_add_rms_norm_op = nk.op(
    "neuron_kernels::add_rms_norm", _add_rms_norm, attributes={"eps": "float"},
    outputs=lambda x, r, w, eps: [(x.shape, x.dtype), (x.shape, x.dtype)],
    grid=lambda x, r, w, eps: (x.shape[0] // row_block(x.shape[0]),),
    constants=lambda x, r, w, eps: {"ROWS": row_block(x.shape[0]), "EPS": eps},
    **reference_autograd(add_rms_norm_reference, 3))


def _rows(x):
    return x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x


def rms_norm(x, weight, eps: float = 1e-6):
    """x * rsqrt(mean(x², last dim) + eps) * weight, computed in float32."""
    rows = _rows(x)
    if not on_device(x, weight) or not row_block(rows.shape[0]):
        return rms_norm_reference(x, weight, eps)
    return _rms_norm_op(rows, weight.reshape(1, -1), float(eps)).view(x.shape)


def add_rms_norm(x, residual, weight, eps: float = 1e-6):
    """(rms_norm(x + residual), x + residual) in one pass over the rows."""
    rows = _rows(x)
    if not on_device(x, residual, weight) or x.shape != residual.shape or not row_block(rows.shape[0]):
        return add_rms_norm_reference(x, residual, weight, eps)
    out, h = _add_rms_norm_op(rows, _rows(residual), weight.reshape(1, -1), float(eps))
    return out.view(x.shape), h.view(x.shape)


__all__ = ["add_rms_norm", "add_rms_norm_reference", "rms_norm", "rms_norm_reference"]
