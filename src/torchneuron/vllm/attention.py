"""Attention over vLLM's paged KV cache on neuron.

The cache of a layer is vLLM's `[blocks, kv heads, block tokens, 2 * head
size]` view in the LBNHC layout, so that memory holds `[blocks, block
tokens, kv heads, K | V]`: a token's slot (block * block size + offset) is
one row of a `[slots, kv heads, 2 * head size]` view. New keys and values
go into their slots with one `index_put_`; attention is the kernel
library's paged attention (torchneuron.kernels.paged_attention), which
reads each request's blocks through its block table where they lie and
masks by the query lengths, the context lengths, causality and any sliding
window.

Every shape the device sees is padded to a power of two (the requests of
the step, the longest query, the blocks of the longest context), so a
decode step reuses the executables of the steps before it instead of
compiling per length; padded requests have no context and padded query
rows give 0. The per-step index tensors are built on the host once per
step and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from ..kernels import paged_attention
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
    # [requests, padded blocks] (int32): block ids of each request's context.
    block_table: torch.Tensor
    # [requests] (int32): each request's context (with this step's tokens) and query length.
    context_lens: torch.Tensor
    query_lens: torch.Tensor


class NeuronAttentionMetadataBuilder(AttentionMetadataBuilder[NeuronAttentionMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size
        self.max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        self.max_requests = vllm_config.scheduler_config.max_num_seqs

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> NeuronAttentionMetadata:
        m = common_attn_metadata
        requests = m.num_reqs
        starts = m.query_start_loc_cpu[: requests + 1].numpy().astype(np.int64)
        query_lens = np.diff(starts)
        context = m.seq_lens_cpu_upper_bound if m.seq_lens_cpu_upper_bound is not None else m.seq_lens.cpu()
        context_lens = context[:requests].numpy().astype(np.int64)

        table = m.block_table_tensor
        padded_requests = min(bucket(requests, self.max_requests), table.shape[0])
        padded_query = bucket(int(query_lens.max()))
        padded_blocks = min(bucket(int(-(-context_lens.max() // self.block_size))), table.shape[1])
        padded_tokens = bucket(m.num_actual_tokens, self.max_tokens)

        q = np.arange(padded_query)
        query_rows = np.zeros((padded_requests, padded_query), dtype=np.int64)
        query_rows[:requests] = np.where(q[None, :] < query_lens[:, None], starts[:-1, None] + q[None, :], 0)
        output_rows = np.zeros(padded_tokens, dtype=np.int64)
        for r in range(requests):
            output_rows[starts[r]:starts[r + 1]] = r * padded_query + np.arange(query_lens[r])
        # Padded requests have no context: the kernel masks every key and gives 0.
        lengths = np.zeros((2, padded_requests), dtype=np.int32)
        lengths[0, :requests], lengths[1, :requests] = context_lens, query_lens

        to_device = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(self.device)  # noqa: E731
        lengths = to_device(lengths)
        return NeuronAttentionMetadata(
            num_actual_tokens=m.num_actual_tokens,
            query_rows=to_device(query_rows),
            output_rows=to_device(output_rows),
            block_table=table[:padded_requests, :padded_blocks].to(torch.int32),
            context_lens=lengths[0],
            query_lens=lengths[1],
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
        tokens = query.shape[0]
        q = query.view(tokens, self.num_heads, self.head_size)[meta.query_rows].transpose(1, 2)
        attended = paged_attention(q, self._slots(kv_cache), meta.block_table, meta.context_lens, meta.query_lens,
                                   scale=self.scale, block_size=kv_cache.shape[2],
                                   sliding_window=self.sliding_window or 0)
        rows = attended.transpose(1, 2).reshape(-1, self.num_heads * self.head_size)
        out = output.view(output.shape[0], -1)
        out[:tokens] = rows[meta.output_rows[:tokens]]
        return output
