"""Flash attention, forward and backward. The forward: each program takes a
block of queries of one batch-head and streams the keys and values in
blocks with an online softmax, so memory grows with the sequence, not with
its square; it also keeps each row's log-sum-exp. The backward recomputes
the probabilities from it, block by block: one kernel per key block
accumulates dK and dV over the query blocks, one per query block
accumulates dQ over the key blocks (FlashAttention-2's split, no atomics).
Causal attention with square blocks skips the blocks the mask empties."""

from __future__ import annotations

import math

import torch

from .. import kernel as nk
from ._blocks import on_device, row_block


@nk.jit
def _forward(q, k, v, out, lse, BQ: nk.constexpr, BK: nk.constexpr, CAUSAL: nk.constexpr, SCALE: nk.constexpr):
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
    nk.store(lse[bh, nk.ds(qi * BQ, BQ), :], m + nk.log(total))


def _probabilities(queries, keys, row_lse, rows, j, BK, CAUSAL, SCALE):
    """The forward's probabilities of a (query block, key block) pair."""
    scores = nk.matmul(queries, nk.transpose(keys)) * SCALE
    if CAUSAL:
        columns = nk.arange(BK) + j * BK
        scores = nk.where(columns[None, :] <= rows[:, None], scores, float("-inf"))
    return nk.exp(scores - row_lse)


@nk.jit
def _backward_kv(q, k, v, o, do, lse, dk, dv, BQ: nk.constexpr, BK: nk.constexpr, CAUSAL: nk.constexpr,
                 SCALE: nk.constexpr):
    bh, kj = nk.program_id(0), nk.program_id(1)
    keys = nk.cast(nk.load(k[bh, nk.ds(kj * BK, BK), :]), nk.float32)
    values = nk.cast(nk.load(v[bh, nk.ds(kj * BK, BK), :]), nk.float32)
    dk_acc = nk.zeros((BK, k.shape[2]), nk.float32)
    dv_acc = nk.zeros((BK, k.shape[2]), nk.float32)
    first = kj if CAUSAL and BQ == BK else 0  # query blocks above the diagonal see none of these keys
    for i in nk.sequential_range(q.shape[1] // BQ - first):
        qi = i + first
        block = nk.ds(qi * BQ, BQ)
        queries = nk.cast(nk.load(q[bh, block, :]), nk.float32)
        grad = nk.cast(nk.load(do[bh, block, :]), nk.float32)
        delta = nk.sum(grad * nk.cast(nk.load(o[bh, block, :]), nk.float32), axis=1, keepdims=True)
        p = _probabilities(queries, keys, nk.load(lse[bh, block, :]), nk.arange(BQ) + qi * BQ, kj, BK, CAUSAL, SCALE)
        dv_acc += nk.matmul(nk.transpose(p), grad)
        ds = p * (nk.matmul(grad, nk.transpose(values)) - delta)
        dk_acc += nk.matmul(nk.transpose(ds), queries) * SCALE
    nk.store(dk[bh, nk.ds(kj * BK, BK), :], nk.cast(dk_acc, dk.dtype))
    nk.store(dv[bh, nk.ds(kj * BK, BK), :], nk.cast(dv_acc, dv.dtype))


@nk.jit
def _backward_q(q, k, v, o, do, lse, dq, BQ: nk.constexpr, BK: nk.constexpr, CAUSAL: nk.constexpr,
                SCALE: nk.constexpr):
    bh, qi = nk.program_id(0), nk.program_id(1)
    block = nk.ds(qi * BQ, BQ)
    queries = nk.cast(nk.load(q[bh, block, :]), nk.float32)
    grad = nk.cast(nk.load(do[bh, block, :]), nk.float32)
    delta = nk.sum(grad * nk.cast(nk.load(o[bh, block, :]), nk.float32), axis=1, keepdims=True)
    row_lse = nk.load(lse[bh, block, :])
    rows = nk.arange(BQ) + qi * BQ
    acc = nk.zeros((BQ, q.shape[2]), nk.float32)
    for j in nk.sequential_range(qi + 1 if CAUSAL and BQ == BK else k.shape[1] // BK):
        keys = nk.cast(nk.load(k[bh, nk.ds(j * BK, BK), :]), nk.float32)
        values = nk.cast(nk.load(v[bh, nk.ds(j * BK, BK), :]), nk.float32)
        p = _probabilities(queries, keys, row_lse, rows, j, BK, CAUSAL, SCALE)
        ds = p * (nk.matmul(grad, nk.transpose(values)) - delta)
        acc += nk.matmul(ds, keys) * SCALE
    nk.store(dq[bh, block, :], nk.cast(acc, dq.dtype))


def _blocks(q, k, causal, scale):
    return {"BQ": row_block(q.shape[1]), "BK": row_block(k.shape[1]), "CAUSAL": bool(causal), "SCALE": float(scale)}


_backward_kv_op = nk.op(
    "neuron_kernels::flash_attention_backward_kv", _backward_kv, attributes={"causal": "bool", "scale": "float"},
    outputs=lambda q, k, v, o, do, lse, causal, scale: [(k.shape, k.dtype), (v.shape, v.dtype)],
    grid=lambda q, k, v, o, do, lse, causal, scale: (k.shape[0], k.shape[1] // row_block(k.shape[1])),
    constants=lambda q, k, v, o, do, lse, causal, scale: _blocks(q, k, causal, scale))

_backward_q_op = nk.op(
    "neuron_kernels::flash_attention_backward_q", _backward_q, attributes={"causal": "bool", "scale": "float"},
    outputs=lambda q, k, v, o, do, lse, causal, scale: [(q.shape, q.dtype)],
    grid=lambda q, k, v, o, do, lse, causal, scale: (q.shape[0], q.shape[1] // row_block(q.shape[1])),
    constants=lambda q, k, v, o, do, lse, causal, scale: _blocks(q, k, causal, scale))


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.scale = causal, scale


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    grad_out = torch.zeros_like(out) if grad_out is None else grad_out.contiguous()
    dk, dv = _backward_kv_op(q, k, v, out, grad_out, lse, ctx.causal, ctx.scale)
    dq = _backward_q_op(q, k, v, out, grad_out, lse, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None


_flash_attention_op = nk.op(
    "neuron_kernels::flash_attention", _forward, attributes={"causal": "bool", "scale": "float"},
    outputs=lambda q, k, v, causal, scale: [(q.shape, q.dtype), ((q.shape[0], q.shape[1], 1), torch.float32)],
    grid=lambda q, k, v, causal, scale: (q.shape[0], q.shape[1] // row_block(q.shape[1])),
    constants=lambda q, k, v, causal, scale: _blocks(q, k, causal, scale),
    backward=_backward, setup_context=_setup_context)


def flash_attention_reference(q, k, v, causal: bool = False, scale: float | None = None):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def flash_attention(q, k, v, causal: bool = False, scale: float | None = None):
    """softmax(q kᵀ · scale [+ causal mask]) v for q, k, v of shape
    [..., S, D] (D at most 128), as scaled_dot_product_attention computes
    it; the causal mask as is_causal's (square). Forward and backward are
    kernels."""
    shape = q.shape
    if (q.dim() < 2 or k.shape != v.shape or q.shape[:-2] != k.shape[:-2] or q.shape[-1] != k.shape[-1]
            or q.shape[-1] > nk.PMAX or (causal and q.shape[-2] != k.shape[-2]) or not on_device(q, k, v)
            or len({q.dtype, k.dtype, v.dtype}) != 1 or not row_block(q.shape[-2]) or not row_block(k.shape[-2])):
        return flash_attention_reference(q, k, v, causal, scale)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    q3, k3, v3 = (t.reshape(-1, t.shape[-2], t.shape[-1]) for t in (q, k, v))
    out, _ = _flash_attention_op(q3, k3, v3, bool(causal), scale)
    return out.view(shape)


__all__ = ["flash_attention", "flash_attention_reference"]
