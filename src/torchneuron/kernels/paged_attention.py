"""Paged attention: attention of each request's queries over its keys and
values where they lie, in the blocks of a paged KV cache (vLLM's), found
through the request's block table, with no gathered copy of its context.

One program per request and KV head (and, when they do not fit one tile,
per part of the query heads sharing that KV head): the query heads are
stacked so that one matmul serves them all, and the program streams the
request's blocks, up to 128 slots at a time, with an online softmax
(FlashAttention's), loading each block's keys and values with a gather of
its slots. Fewer, larger programs matter: at decode shapes a program per
query head and block was 2-3x slower than gathering the context and
running SDPA as eager ops; this form is 2-10x faster than that. The mask
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
from ._blocks import on_device, row_block

_HIDDEN = -1.0e30  # a masked score: finite, so a block with no visible key leaves no NaN


@nk.jit
def _paged(q, cache, block_table, context_lens, query_lens, out, GP: nk.constexpr, BS: nk.constexpr,
           CB: nk.constexpr, SCALE: nk.constexpr, WINDOW: nk.constexpr):
    r, kv, part = nk.program_id(0), nk.program_id(1), nk.program_id(2)
    rows, size = q.shape[2], q.shape[3]
    first = kv * (q.shape[1] // cache.shape[1]) + part * GP  # this program's first query head
    context = nk.load(context_lens[nk.ds(r, 1)])  # [1]
    query_len = nk.load(query_lens[nk.ds(r, 1)])
    # The program's query heads share their KV head: stacked, one matmul serves them all.
    queries = nk.zeros((GP * rows, size), nk.float32)
    row = nk.zeros((GP * rows,), nk.int32)  # each stacked row's query index
    for g in nk.static_range(GP):
        queries[g * rows:(g + 1) * rows, :] = nk.cast(nk.load(q[r, first + g, :, :]), nk.float32) * SCALE
        row[g * rows:(g + 1) * rows] = nk.arange(rows)
    position = row + (context - query_len)  # each query's position in its sequence
    m = nk.full((GP * rows, 1), _HIDDEN, nk.float32)
    total = nk.zeros((GP * rows, 1), nk.float32)
    acc = nk.zeros((GP * rows, size), nk.float32)
    for j in nk.sequential_range(block_table.shape[1] // CB):  # CB blocks at a time
        keys = nk.zeros((CB * BS, size), nk.float32)
        values = nk.zeros((CB * BS, size), nk.float32)
        for b in nk.static_range(CB):
            block = nk.load(block_table[r, nk.ds(j * CB + b, 1)])  # [1]: the block of positions (j*CB+b)*BS...
            slots = nk.arange(BS) + block * BS
            keys[b * BS:(b + 1) * BS, :] = nk.cast(nk.load(cache[slots, kv, nk.ds(0, size)]), nk.float32)
            values[b * BS:(b + 1) * BS, :] = nk.cast(nk.load(cache[slots, kv, nk.ds(size, size)]), nk.float32)
        columns = nk.arange(CB * BS) + j * (CB * BS)
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
    attended = nk.where((row < query_len)[:, None], acc / nk.maximum(total, 1.0e-30), 0.0)
    for g in nk.static_range(GP):
        nk.store(out[r, first + g, :, :], nk.cast(attended[g * rows:(g + 1) * rows, :], out.dtype))


def _group(q, cache) -> int:
    """Query heads per program: the most of a KV head's group whose stacked
    queries fit a tile's 128 rows."""
    return row_block(q.shape[1] // cache.shape[1], max(1, nk.PMAX // q.shape[2]))


def _constants(q, cache, block_table, context_lens, query_lens, scale, block_size, sliding_window):
    return {"GP": _group(q, cache), "BS": block_size, "CB": row_block(block_table.shape[1], nk.PMAX // block_size),
            "SCALE": float(scale), "WINDOW": int(sliding_window)}


_paged_op = nk.op(
    "neuron_kernels::paged_attention", _paged,
    attributes={"scale": "float", "block_size": "int", "sliding_window": "int"},
    outputs=lambda q, cache, block_table, context_lens, query_lens, scale, block_size, sliding_window: [
        (q.shape, q.dtype)],
    grid=lambda q, cache, block_table, context_lens, query_lens, scale, block_size, sliding_window: (
        q.shape[0], cache.shape[1], q.shape[1] // cache.shape[1] // _group(q, cache)),
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
