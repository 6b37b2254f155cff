"""vLLM's model runner on a neuron device.

vLLM's GPU model runner prepares inputs in host buffers, copies them to the
device, runs the model and samples on the device; it works on any PyTorch
device once CUDA graphs, extra CUDA streams and CUDA-only kernels are left
out (the platform turns them off). What this subclass adds: every step's
token count is padded to a power of two (buckets.py), so that the model's
ops see a few shapes and reuse their executables, and the few places that
name CUDA are answered for neuron.
"""

from __future__ import annotations

import dataclasses

import torch
from vllm.logger import init_logger
from vllm.model_executor.model_loader import get_model
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from .buckets import bucket

logger = init_logger(__name__)


class NeuronModelRunner(GPUModelRunner):
    def __init__(self, vllm_config, device: torch.device):
        super().__init__(vllm_config, device)
        self.use_cuda_graph = False

    def load_model(self, load_dummy_weights: bool = False) -> None:
        if load_dummy_weights:
            raise ValueError("dummy weights (elastic expert parallelism) are not supported on neuron")
        logger.info("Loading model %s onto %s", self.model_config.model, self.device)
        self.model = get_model(vllm_config=self.vllm_config)
        if self.lora_config:
            self.model = self.load_lora_model(self.model, self.vllm_config, self.device)

    def get_model(self):
        return self.model

    def _determine_batch_execution_and_padding(self, num_tokens: int, *args, **kwargs):
        mode, descriptor, should_ubatch, across_dp, stats = super()._determine_batch_execution_and_padding(
            num_tokens, *args, **kwargs)
        padded = bucket(descriptor.num_tokens, self.max_num_tokens)
        if padded != descriptor.num_tokens:
            descriptor = dataclasses.replace(descriptor, num_tokens=padded)
        return mode, descriptor, should_ubatch, across_dp, stats

    def _init_kv_zero_meta(self) -> None:
        pass  # _zero_block_ids below needs no precomputed state

    def _zero_block_ids(self, block_ids: list[int]) -> None:
        """Zero newly allocated full-attention blocks (stale keys must not
        leak into a partially written block): one index_fill_ per cache."""
        if not block_ids:
            return
        seen = set()
        index = None
        for group in self.kv_cache_config.kv_cache_groups:
            if not isinstance(group.kv_cache_spec, FullAttentionSpec):
                continue
            for name in group.layer_names:
                context = self.compilation_config.static_forward_context.get(name)
                cache = getattr(context, "kv_cache", None)
                if not isinstance(cache, torch.Tensor) or id(cache) in seen:
                    continue
                seen.add(id(cache))
                if index is None:
                    index = torch.tensor(block_ids, dtype=torch.int64).to(cache.device)
                cache.index_fill_(0, index, 0)

    def _sync_device(self) -> None:
        torch.neuron.synchronize(self.device)

    def _to_list(self, sampled_token_ids: torch.Tensor) -> list[list[int]]:
        return sampled_token_ids.tolist()
