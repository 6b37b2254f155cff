"""Flash attention (forward): each program takes a block of queries of one
batch-head and streams the keys and values in blocks with an online
softmax, so memory grows with the sequence, not with its square."""

from __future__ import annotations

import math

import torch

from .. import kernel as nk
from ._blocks import on_device, reference_autograd, row_block


@nk.jit
def _flash_attention(q, k, v, out, BQ: nk.constexpr, BK: nk.constexpr, CAUSAL: nk.constexpr, SCALE: nk.constexpr):
    bh, qi = nk.program_id(0), nk.program_id(1)
    queries = nk.cast(nk.load(q[bh, nk.ds(qi * BQ, BQ), :]), nk.float32) * SCALE
    m = nk.full((BQ, 1), float("-inf"), nk.float32)
    total = nk.zeros((BQ, 1), nk.float32)
    acc = nk.zeros((BQ, q.shape[2]), nk.float32)
    rows = nk.arange(BQ) + qi * BQ
    # Causal with square blocks: blocks right of the diagonal are all masked, skip them.
    for j in nk.sequential_range(qi + 1 if CAUSAL and BQ == BK else k.shape[1] // BK):
        keys = nk.cast(nk.load(k[bh, nk.ds(j * BK, BK), :]), nk.float32)
        values = nk.cast(nk.load(v[bh, nk.ds(j * BK, BK), :]), nk.float32)
        scores = nk.matmul(queries, nk.transpose(keys))
        if CAUSAL:
            columns = nk.arange(BK) + j * BK
            scores = nk.where(columns[None, :] <= rows[:, None], scores, float("-inf"))
        m_new = nk.maximum(m, nk.max(scores, axis=1, keepdims=True))
        p = nk.exp(scores - m_new)
        rescale = nk.exp(m - m_new)
        total[...] = total * rescale + nk.sum(p, axis=1, keepdims=True)
        acc[...] = acc * rescale + nk.matmul(p, values)
        m[...] = m_new
    nk.store(out[bh, nk.ds(qi * BQ, BQ), :], nk.cast(acc / total, out.dtype))


def flash_attention_reference(q, k, v, causal: bool = False, scale: float | None = None):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def _reference_3d(q, k, v, causal, scale):
    return flash_attention_reference(q, k, v, causal, scale)


_flash_attention_op = nk.op(
    "neuron_kernels::flash_attention", _flash_attention, attributes={"causal": "bool", "scale": "float"},
    outputs=lambda q, k, v, causal, scale: [(q.shape, q.dtype)],
    grid=lambda q, k, v, causal, scale: (q.shape[0], q.shape[1] // row_block(q.shape[1])),
    constants=lambda q, k, v, causal, scale: {"BQ": row_block(q.shape[1]), "BK": row_block(k.shape[1]),
                                              "CAUSAL": bool(causal), "SCALE": float(scale)},
    **reference_autograd(_reference_3d, 3))


def flash_attention(q, k, v, causal: bool = False, scale: float | None = None):
    """softmax(q kᵀ · scale [+ causal mask]) v for q, k, v of shape
    [..., S, D] (D at most 128), as scaled_dot_product_attention computes
    it; the causal mask as is_causal's (square). The forward is the kernel;
    gradients come from the reference."""
    shape = q.shape
    if (q.dim() < 2 or k.shape != v.shape or q.shape[:-2] != k.shape[:-2] or q.shape[-1] != k.shape[-1]
            or q.shape[-1] > nk.PMAX or (causal and q.shape[-2] != k.shape[-2]) or not on_device(q, k, v)
            or not row_block(q.shape[-2]) or not row_block(k.shape[-2])):
        return flash_attention_reference(q, k, v, causal, scale)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    q3, k3, v3 = (t.reshape(-1, t.shape[-2], t.shape[-1]) for t in (q, k, v))
    return _flash_attention_op(q3, k3, v3, bool(causal), scale).view(shape)


__all__ = ["flash_attention", "flash_attention_reference"]
