"""Paged attention: attention of each request's queries over its keys and
values where they lie, in the blocks of a paged KV cache (vLLM's), found
through the request's block table, with no gathered copy of its context.

One program per (request, KV head, query head of that KV head's group):
it streams the request's blocks with an online softmax (FlashAttention's),
loading each block's keys and values with a gather of its slots. The mask
is computed in the kernel from the request's context and query lengths:
query q of a request sits at position context - query_len + q and sees the
keys at positions up to its own (and, with a sliding window W, above
position - W). Query rows past a request's query length (padding) give 0.

The cache is `[slots, kv heads, 2 * head size]`, each slot's key and value
side by side (slot = block * block_size + offset), the layout torchneuron's
vLLM backend keeps; the reference gathers the blocks and runs
scaled_dot_product_attention under the same mask.
"""

from __future__ import annotations

import math

import torch

from .. import kernel as nk
from ._blocks import on_device

_HIDDEN = -1.0e30  # a masked score: finite, so a block with no visible key leaves no NaN


@nk.jit
def _paged(q, cache, block_table, context_lens, query_lens, out, G: nk.constexpr, BS: nk.constexpr,
           SCALE: nk.constexpr, WINDOW: nk.constexpr):
    r, kv, g = nk.program_id(0), nk.program_id(1), nk.program_id(2)
    head = kv * G + g
    size = q.shape[3]
    queries = nk.cast(nk.load(q[r, head, :, :]), nk.float32) * SCALE  # [Q, D]
    context = nk.load(context_lens[nk.ds(r, 1)])  # [1]
    query_len = nk.load(query_lens[nk.ds(r, 1)])
    rows = nk.arange(q.shape[2])
    position = rows + (context - query_len)  # each query's position in its sequence
    m = nk.full((q.shape[2], 1), _HIDDEN, nk.float32)
    total = nk.zeros((q.shape[2], 1), nk.float32)
    acc = nk.zeros((q.shape[2], size), nk.float32)
    for j in nk.sequential_range(block_table.shape[1]):
        block = nk.load(block_table[r, nk.ds(j, 1)])  # [1]: the block holding positions j*BS ...
        slots = nk.arange(BS) + block * BS
        keys = nk.cast(nk.load(cache[slots, kv, nk.ds(0, size)]), nk.float32)  # [BS, D]
        values = nk.cast(nk.load(cache[slots, kv, nk.ds(size, size)]), nk.float32)
        columns = nk.arange(BS) + j * BS
        visible = (columns[None, :] <= position[:, None]) & (columns[None, :] < context[:, None])
        if WINDOW:
            visible = visible & (columns[None, :] > position[:, None] - WINDOW)
        scores = nk.where(visible, nk.matmul(queries, nk.transpose(keys)), _HIDDEN)
        m_new = nk.maximum(m, nk.max(scores, axis=1, keepdims=True))
        p = nk.where(visible, nk.exp(scores - m_new), 0.0)
        rescale = nk.exp(m - m_new)
        total[...] = total * rescale + nk.sum(p, axis=1, keepdims=True)
        acc[...] = acc * rescale + nk.matmul(p, values)
        m[...] = m_new
    attended = acc / nk.maximum(total, 1.0e-30)
    nk.store(out[r, head, :, :], nk.cast(nk.where((rows < query_len)[:, None], attended, 0.0), out.dtype))


def _constants(q, cache, block_table, context_lens, query_lens, scale, block_size, sliding_window):
    return {"G": q.shape[1] // cache.shape[1], "BS": block_size, "SCALE": float(scale),
            "WINDOW": int(sliding_window)}


_paged_op = nk.op(
    "neuron_kernels::paged_attention", _paged,
    attributes={"scale": "float", "block_size": "int", "sliding_window": "int"},
    outputs=lambda q, cache, block_table, context_lens, query_lens, scale, block_size, sliding_window: [
        (q.shape, q.dtype)],
    grid=lambda q, cache, block_table, context_lens, query_lens, scale, block_size, sliding_window: (
        q.shape[0], cache.shape[1], q.shape[1] // cache.shape[1]),
    constants=_constants)


def _visible(query, context_lens, query_lens, keys: int, sliding_window: int):
    """[R, Q, keys] which keys each query sees, and [R, Q] which query rows are real."""
    rows = torch.arange(query.shape[2], device=query.device)
    position = (context_lens - query_lens).long()[:, None] + rows  # [R, Q]
    k = torch.arange(keys, device=query.device)
    visible = (k[None, None, :] <= position[:, :, None]) & (k[None, None, :] < context_lens.long()[:, None, None])
    if sliding_window:
        visible &= k[None, None, :] > position[:, :, None] - sliding_window
    return visible, rows[None, :] < query_lens.long()[:, None]


def paged_attention_reference(query, kv_cache, block_table, context_lens, query_lens, scale: float | None = None,
                              block_size: int = 16, sliding_window: int = 0):
    """The request's blocks gathered into one context, then
    scaled_dot_product_attention under the kernel's mask."""
    requests, heads, _, size = query.shape
    kv_heads = kv_cache.shape[1]
    scale = 1.0 / math.sqrt(size) if scale is None else float(scale)
    offsets = torch.arange(block_size, device=query.device)
    slots = (block_table.long()[:, :, None] * block_size + offsets).reshape(requests, -1)  # [R, C]
    context = kv_cache[slots].transpose(1, 2)  # [R, KV heads, C, 2D]
    keys, values = context[..., :size], context[..., size:]
    visible, real = _visible(query, context_lens, query_lens, slots.shape[1], sliding_window)
    # Padded query rows see every key (a finite softmax); their output is 0.
    mask = (visible | ~real[:, :, None])[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(query, keys.to(query.dtype), values.to(query.dtype),
                                                           attn_mask=mask, scale=scale,
                                                           enable_gqa=heads != kv_heads)
    return torch.where(real[:, None, :, None], out, torch.zeros((), dtype=out.dtype, device=out.device))


def paged_attention(query, kv_cache, block_table, context_lens, query_lens, scale: float | None = None,
                    block_size: int = 16, sliding_window: int = 0):
    """Attention for query [R, H, Q, D] (each request's queries, padded to Q
    rows) over kv_cache [slots, KV heads, 2 * D] (key | value per slot)
    through block_table [R, blocks] (int32), with context_lens and
    query_lens [R] (int32): query q of request r sits at position
    context_lens[r] - query_lens[r] + q and attends causally (within the
    sliding window if one is given). Rows q >= query_lens[r] give 0.
    The kernel takes D <= 128, Q <= 128, block_size <= 128 and H a multiple
    of KV heads."""
    ok = (query.dim() == 4 and kv_cache.dim() == 3 and block_table.dim() == 2
          and kv_cache.shape[2] == 2 * query.shape[3] and query.shape[3] <= nk.PMAX and query.shape[2] <= nk.PMAX
          and 0 < block_size <= nk.PMAX and kv_cache.shape[0] % block_size == 0
          and query.shape[1] % kv_cache.shape[1] == 0 and block_table.shape[0] == query.shape[0]
          and on_device(query, kv_cache) and query.dtype == kv_cache.dtype
          and all(t.dtype == torch.int32 and t.device == query.device for t in (block_table, context_lens, query_lens)))
    if not ok:
        return paged_attention_reference(query, kv_cache, block_table, context_lens, query_lens, scale, block_size,
                                         sliding_window)
    scale = 1.0 / math.sqrt(query.shape[3]) if scale is None else float(scale)
    return _paged_op(query.contiguous(), kv_cache.contiguous(), block_table.contiguous(), context_lens.contiguous(),
                     query_lens.contiguous(), scale, int(block_size), int(sliding_window or 0))


__all__ = ["paged_attention", "paged_attention_reference"]
