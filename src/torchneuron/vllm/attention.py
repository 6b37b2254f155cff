"""Attention over vLLM's paged KV cache on neuron, in PyTorch ops.

The cache of a layer is vLLM's `[blocks, kv heads, block tokens, 2 * head
size]` view in the LBNHC layout, so that memory holds `[blocks, block
tokens, kv heads, K | V]`: a token's slot (block * block size + offset) is
one row of a `[slots, kv heads, 2 * head size]` view. New keys and values
go into their slots with one `index_put_`; attention gathers each request's
blocks through its block table and runs scaled dot-product attention under
a mask that encodes the query lengths, the context lengths, causality and
any sliding window.

Every shape the device sees is padded to a power of two (the longest query
of the batch, the blocks of the longest context), so a decode step reuses
the executables of the steps before it instead of compiling per length; the
mask hides what padding adds. The per-step index and mask tensors are built
on the host once per step and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from .buckets import bucket


class NeuronAttentionBackend(AttentionBackend):
    # vLLM writes the step's keys and values (do_kv_cache_update) before
    # forward, with padded tokens' slots set to -1.
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float32, torch.bfloat16, torch.float16]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", "float32", "float16", "bfloat16"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls():
        return NeuronAttentionImpl

    @staticmethod
    def get_builder_cls():
        return NeuronAttentionMetadataBuilder

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any

    @classmethod
    def supported_kv_cache_layouts(cls):
        return (KVCacheLayout.LBNHC,)

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


@dataclass
class NeuronAttentionMetadata:
    num_actual_tokens: int
    # [requests, padded query]: each query row's token in the step's batch.
    query_rows: torch.Tensor
    # [padded tokens]: each token's row in the flattened [requests * padded query] output.
    output_rows: torch.Tensor
    # [requests, padded blocks]: block ids of each request's context.
    block_table: torch.Tensor
    # [requests, 1, padded query, padded context]: which keys each query attends.
    mask: torch.Tensor


class NeuronAttentionMetadataBuilder(AttentionMetadataBuilder[NeuronAttentionMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size
        self.sliding_window = getattr(kv_cache_spec, "sliding_window", None)
        self.max_blocks = -(-vllm_config.model_config.max_model_len // self.block_size)
        self.max_tokens = vllm_config.scheduler_config.max_num_batched_tokens

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> NeuronAttentionMetadata:
        m = common_attn_metadata
        requests = m.num_reqs
        starts = m.query_start_loc_cpu[: requests + 1].numpy().astype(np.int64)
        query_lens = np.diff(starts)
        context = m.seq_lens_cpu_upper_bound if m.seq_lens_cpu_upper_bound is not None else m.seq_lens.cpu()
        context_lens = context[:requests].numpy().astype(np.int64)

        padded_query = bucket(int(query_lens.max()))
        table_width = m.block_table_tensor.shape[1]
        padded_blocks = min(bucket(int(-(-context_lens.max() // self.block_size))), table_width)
        padded_context = padded_blocks * self.block_size
        padded_tokens = bucket(m.num_actual_tokens, self.max_tokens)

        q = np.arange(padded_query)
        real_query = q[None, :] < query_lens[:, None]  # [R, Q]
        query_rows = np.where(real_query, starts[:-1, None] + q[None, :], 0)
        output_rows = np.zeros(padded_tokens, dtype=np.int64)
        for r in range(requests):
            output_rows[starts[r]:starts[r + 1]] = r * padded_query + np.arange(query_lens[r])

        # Query q of request r sits at position context - query_len + q.
        position = (context_lens - query_lens)[:, None] + q[None, :]  # [R, Q]
        k = np.arange(padded_context)
        mask = (k[None, None, :] <= position[:, :, None]) & (k[None, None, :] < context_lens[:, None, None])
        if self.sliding_window is not None:
            mask &= k[None, None, :] > position[:, :, None] - self.sliding_window
        # Padded query rows attend key 0 so that their softmax stays finite.
        mask[:, :, 0] |= ~real_query

        to_device = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(self.device)  # noqa: E731
        return NeuronAttentionMetadata(
            num_actual_tokens=m.num_actual_tokens,
            query_rows=to_device(query_rows),
            output_rows=to_device(output_rows),
            block_table=m.block_table_tensor[:requests, :padded_blocks],
            mask=to_device(mask[:, None]),
        )


class NeuronAttentionImpl(AttentionImpl):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None, kv_cache_dtype: str,
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, sinks: torch.Tensor | None = None):
        unsupported = {"ALiBi": alibi_slopes is not None, "logits soft-capping": bool(logits_soft_cap),
                       "attention sinks": sinks is not None,
                       f"{attn_type} attention": attn_type != AttentionType.DECODER}
        if any(unsupported.values()):
            raise NotImplementedError(
                "neuron's vLLM attention does not support "
                + ", ".join(name for name, used in unsupported.items() if used) + " yet")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.attn_type = attn_type

    @staticmethod
    def _slots(kv_cache: torch.Tensor) -> torch.Tensor:
        """The layer's cache as [slots, kv heads, 2 * head size] (a view)."""
        blocks, heads, block_size, content = kv_cache.shape
        return kv_cache.permute(0, 2, 1, 3).reshape(blocks * block_size, heads, content)

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        tokens = slot_mapping.shape[0]
        # Padded tokens (slot -1) write into slot 0: block 0 is vLLM's null
        # block, never given to a request, and masked wherever it is read.
        slots = slot_mapping.clamp(min=0)
        rows = torch.cat([key[:tokens], value[:tokens]], dim=-1).to(kv_cache.dtype)
        self._slots(kv_cache).index_put_((slots,), rows)

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: NeuronAttentionMetadata | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None, output_block_scale: torch.Tensor | None = None):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported on neuron")
        if attn_metadata is None:  # a profiling run without a cache
            return output.fill_(0)
        meta = attn_metadata
        requests, blocks = meta.block_table.shape
        _, heads, block_size, content = kv_cache.shape
        # [R, blocks, block tokens, heads, K|V] -> [R, heads, context, K|V]
        context = kv_cache.permute(0, 2, 1, 3)[meta.block_table]
        context = context.reshape(requests, blocks * block_size, heads, content).transpose(1, 2)
        keys, values = context[..., : self.head_size], context[..., self.head_size:]
        tokens = query.shape[0]
        q = query.view(tokens, self.num_heads, self.head_size)[meta.query_rows].transpose(1, 2)
        attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=meta.mask, scale=self.scale,
                                                  enable_gqa=self.num_heads != self.num_kv_heads)
        rows = attended.transpose(1, 2).reshape(-1, self.num_heads * self.head_size)
        out = output.view(output.shape[0], -1)
        out[:tokens] = rows[meta.output_rows[:tokens]]
        return output
