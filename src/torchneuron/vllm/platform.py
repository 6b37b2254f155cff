"""The neuron platform vLLM runs on: what vLLM asks of a device.

Modelled on vLLM's CPU platform (an out-of-tree platform gets vLLM's generic
paths: `CustomOp` layers run their plain PyTorch `forward_native`). What
differs is the device: weights, activations and the paged KV cache are
neuron tensors, collectives go through torchneuron's c10d backend, and
compiled graphs go to `torch.compile(backend="neuron")`.
"""

from __future__ import annotations

import dataclasses
import os

import torch
from vllm.logger import init_logger
from vllm.platforms.interface import Platform, PlatformEnum

logger = init_logger(__name__)

WORKER = "torchneuron.vllm.worker.NeuronWorker"
ATTENTION = "torchneuron.vllm.attention.NeuronAttentionBackend"


class NeuronPlatform(Platform):
    _enum = PlatformEnum.OOT
    device_name: str = "neuron"
    device_type: str = "neuron"
    dispatch_key: str = "PrivateUse1"
    dist_backend: str = "neuron"  # torchneuron.distributed's c10d backend
    simple_compile_backend: str = "neuron"

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def check_if_supports_dtype(cls, dtype: torch.dtype) -> None:
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"neuron serves models in float32, bfloat16 or float16, not {dtype}")

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return torch.neuron.get_device_name(device_id)

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return torch.neuron.mem_get_info(device_id)[1]

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        torch.neuron.set_device(device)

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        torch.neuron.manual_seed_all(seed)

    @classmethod
    def inference_mode(cls):
        return torch.no_grad()

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        # Host-to-device copies are synchronous today: pinning buys nothing.
        return False

    @classmethod
    def get_current_memory_usage(cls, device=None) -> float:
        return float(torch.neuron.memory_allocated(device))

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
        if attn_selector_config.use_mla or attn_selector_config.use_sparse:
            raise NotImplementedError("MLA and sparse attention are not supported on neuron yet")
        if selected_backend is not None and selected_backend.name != "CUSTOM":
            logger.info("Attention backend %s is not available on neuron: using neuron's own", selected_backend.name)
        return ATTENTION

    @classmethod
    def register_triton_kernel_overrides(cls) -> None:
        from vllm.triton_utils.dispatcher import register_kernels

        from .triton_overrides import OVERRIDES

        register_kernels(OVERRIDES)

    @classmethod
    def get_punica_wrapper(cls) -> str:
        return "vllm.lora.punica_wrapper.punica_cpu.PunicaWrapperCPU"

    @classmethod
    def supports_structured_output(cls) -> bool:
        return True

    @classmethod
    def get_compile_backend(cls) -> str:
        """The compiler of vLLM's graph pieces (VLLM_COMPILE)."""
        return "torchneuron.vllm.compiler.NeuronCompiler"

    @classmethod
    def opaque_attention_op(cls) -> bool:
        # Attention stays one custom op in compiled graphs; its metadata
        # (Python objects) never enters a graph.
        return True

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        from vllm.config import CompilationMode, CUDAGraphMode

        parallel_config = vllm_config.parallel_config
        if parallel_config.worker_cls == "auto":
            parallel_config.worker_cls = WORKER
        parallel_config.disable_custom_all_reduce = True
        # vLLM's worker processes must start fresh: a forked child cannot use
        # the parent's device (torch.neuron refuses it, as torch.cuda does).
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"

        # Steps run one after another: the next step's inputs are prepared
        # after this one's tokens are read (no second stream to overlap on).
        vllm_config.scheduler_config.async_scheduling = False

        cache_config = vllm_config.cache_config
        if not cache_config.user_specified_block_size:
            cache_config.block_size = 16

        compilation = vllm_config.compilation_config
        compilation.cudagraph_capture_sizes = []
        compilation.cudagraph_mode = CUDAGraphMode.NONE
        if compilation.mode != CompilationMode.NONE:
            compilation.backend = "neuron"
            # vLLM's ahead-of-time artifacts are Inductor's output code; the
            # neuron backend's executables are cached by torchneuron itself.
            os.environ["VLLM_USE_AOT_COMPILE"] = "0"
        if compilation.mode == CompilationMode.VLLM_COMPILE:
            # vLLM's backend splits the graph at attention; its pieces go to
            # torchneuron (get_compile_backend), not Inductor. vLLM's fusion
            # passes rewrite graphs into CUDA and ROCm kernels: off.
            if compilation.compile_sizes is None:  # set with CUDA graphs' sizes, which are off
                compilation.compile_sizes = []
            passes = compilation.pass_config
            for field in dataclasses.fields(passes):
                if field.name.startswith(("fuse_", "enable_")) and getattr(passes, field.name):
                    setattr(passes, field.name, False)
        vllm_config.profiler_config.torch_profiler_dump_cuda_time_total = False
        if vllm_config.model_config is not None and vllm_config.model_config.use_mla:
            raise NotImplementedError("MLA models are not supported on neuron yet")
