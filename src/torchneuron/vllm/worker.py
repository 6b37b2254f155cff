"""The vLLM worker on a neuron device: one per device, in its own process
(or in the engine's process with VLLM_ENABLE_V1_MULTIPROCESSING=0).

vLLM's GPU worker does the rest (loading, KV cache set-up, execution, the
distributed environment); this class chooses the device, the model runner
and how much device memory the paged KV cache gets.
"""

from __future__ import annotations

import contextlib

import torch
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.utils.mem_utils import format_gib
from vllm.utils.torch_utils import set_random_seed
from vllm.v1.worker.gpu_worker import Worker, init_worker_distributed_environment
from vllm.v1.worker.worker_base import CompilationTimes

logger = init_logger(__name__)


class NeuronWorker(Worker):
    def __init__(self, vllm_config, local_rank: int, rank: int, distributed_init_method: str,
                 is_driver_worker: bool = False):
        from . import custom_ops, moe  # noqa: F401 - neuron's fused MoE method, before the model is built

        custom_ops.register()
        super().__init__(vllm_config, local_rank, rank, distributed_init_method, is_driver_worker=is_driver_worker)
        self.parallel_config.disable_custom_all_reduce = True

    def init_device(self):
        count = torch.neuron.device_count()
        if self.local_rank >= count:
            raise RuntimeError(
                f"vLLM worker {self.local_rank} needs neuron:{self.local_rank}, but {count} neuron "
                f"device(s) are configured (TORCHNEURON_DEVICE_COUNT)")
        self.device = torch.device("neuron", self.local_rank)
        torch.neuron.set_device(self.device)
        current_platform.check_if_supports_dtype(self.model_config.dtype)
        init_worker_distributed_environment(self.vllm_config, self.rank, self.distributed_init_method,
                                            self.local_rank, current_platform.dist_backend)
        set_random_seed(self.model_config.seed)
        self._init_workspace_and_model_runner()

    def _maybe_get_memory_pool_context(self, tag: str):
        # vLLM's sleep-mode memory pool is CUDA's (cumem); neuron has none.
        return contextlib.nullcontext()

    def _make_model_runner(self):
        from .model_runner import NeuronModelRunner

        return NeuronModelRunner(self.vllm_config, self.device)

    @torch.no_grad()
    def determine_available_memory(self) -> int:
        """Bytes for the paged KV cache: `kv_cache_memory_bytes` when given;
        otherwise `gpu_memory_utilization` of the device less the peak a
        largest-batch profiling step held (weights and activations)."""
        explicit = self.cache_config.kv_cache_memory_bytes
        free, total = torch.neuron.mem_get_info(self.device)
        if explicit is not None:
            if explicit > free:
                raise ValueError(
                    f"kv_cache_memory_bytes asks for {format_gib(explicit)} GiB of KV cache, but "
                    f"{self.device} has {format_gib(free)} GiB free of {format_gib(total)} GiB")
            return int(explicit)
        torch.neuron.reset_peak_memory_stats(self.device)
        self.model_runner.profile_run()
        torch.neuron.synchronize(self.device)
        peak = torch.neuron.max_memory_allocated(self.device)
        free, total = torch.neuron.mem_get_info(self.device)
        budget = int(total * self.cache_config.gpu_memory_utilization) - peak
        available = min(budget, free - (total - int(total * self.cache_config.gpu_memory_utilization)))
        if available <= 0:
            raise ValueError(
                f"No memory is left for the KV cache on {self.device}: {format_gib(peak)} GiB were held at "
                f"the profiling step's peak, {format_gib(free)} GiB are free of {format_gib(total)} GiB. Raise "
                f"gpu_memory_utilization ({self.cache_config.gpu_memory_utilization}) or set kv_cache_memory_bytes")
        logger.info("KV cache on %s: %s GiB (peak of the profiling step %s GiB, device %s GiB)",
                    self.device, format_gib(available), format_gib(peak), format_gib(total))
        return available

    def compile_or_warm_up_model(self) -> CompilationTimes:
        # Executables are compiled on first use and kept in torchneuron's
        # caches (memory, disk, the compile service); the profiling step
        # above compiled the largest batch's.
        set_random_seed(self.model_config.seed, self.parallel_config.data_parallel_index)
        return CompilationTimes(language_model=self.compilation_config.compilation_time,
                                encoder=self.compilation_config.encoder_compilation_time)

    def sleep(self, level: int = 1) -> None:
        logger.warning("sleep mode is not supported on neuron: ignored")

    def wake_up(self, tags=None) -> None:
        logger.warning("sleep mode is not supported on neuron: ignored")
