"""vLLM's Triton kernels, answered for neuron.

vLLM prepares some step inputs with small Triton kernels; a platform without
Triton registers implementations of its own (vLLM's CPU platform registers
C++ ones). Only the kernels a plain decoding step meets are here: the
speculative-decoding and Mamba ones are not, and vLLM says so when they are
called.
"""

from __future__ import annotations

import numpy as np
import torch


def compute_slot_mapping(num_tokens: int, max_num_tokens: int, query_start_loc: torch.Tensor,
                         positions: torch.Tensor, block_table: torch.Tensor, block_table_stride: int,
                         slot_mapping: torch.Tensor, KV_CACHE_BLOCK_SIZE: int, TOTAL_CP_WORLD_SIZE: int = 1,
                         TOTAL_CP_RANK: int = 0, CP_KV_CACHE_INTERLEAVE_SIZE: int = 1, PAD_ID: int = -1,
                         BLOCK_SIZE: int = 1024) -> None:
    """Each token's KV cache slot: block_table[request, position // block
    size] * block size + position % block size; PAD_ID past num_tokens.

    Computed on the host: the inputs are a few hundred integers whose sizes
    change every step, and on a compile-first device every new size would be
    a new executable."""
    if TOTAL_CP_WORLD_SIZE != 1:
        raise NotImplementedError("context parallelism is not supported on neuron")
    starts = query_start_loc.cpu().numpy().astype(np.int64)
    where = positions[:num_tokens].cpu().numpy().astype(np.int64)
    tokens = np.arange(num_tokens)
    request = np.searchsorted(starts, tokens, side="right") - 1
    table = block_table.cpu().numpy()
    blocks = table[request, where // KV_CACHE_BLOCK_SIZE].astype(np.int64)
    slots = np.full(max_num_tokens, PAD_ID, dtype=np.int64)
    slots[:num_tokens] = blocks * KV_CACHE_BLOCK_SIZE + where % KV_CACHE_BLOCK_SIZE
    slot_mapping[:max_num_tokens].copy_(torch.from_numpy(slots).to(slot_mapping.dtype))


OVERRIDES = {"vllm.v1.worker.block_table.ComputeSlotMappingKernel.kernel": compute_slot_mapping}
