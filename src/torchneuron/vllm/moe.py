"""vLLM's fused mixture-of-experts layer on neuron.

vLLM's unquantized MoE method builds its expert kernel for CUDA, ROCm, XPU,
TPU and CPU, and leaves an out-of-tree platform to bring its own (its
`moe_kernel` stays None). This method, registered in its place for the
neuron platform, runs the routed experts as the kernel library's
blockwise MoE kernel (torchneuron.kernels.moe_routed): the router's top-k
is vLLM's, the SwiGLU experts (gate | up in w13) are one kernel launch, and
what the kernel does not take (other activations, biases, expert
parallelism, dtypes other than float32) is refused by name or runs the
kernel's PyTorch reference.

Importing this module registers the method (the worker does so before the
model is built).
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.runner.shared_experts import SharedExpertsOrder
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

from ..kernels import moe_routed


@UnquantizedFusedMoEMethod.register_oot
class NeuronFusedMoEMethod(UnquantizedFusedMoEMethod):
    @property
    def is_monolithic(self) -> bool:
        return False  # vLLM routes; the method runs the routed experts (apply)

    def process_weights_after_loading(self, layer) -> None:
        super().process_weights_after_loading(layer)
        unsupported = {"biases": self.moe.has_bias, "expert parallelism": layer.expert_map is not None,
                       "router weights applied to the input": layer.apply_router_weight_on_input,
                       f"the {layer.activation} activation": layer.activation != MoEActivation.SILU}
        if any(unsupported.values()):
            raise NotImplementedError("neuron's vLLM mixture of experts does not support "
                                      + ", ".join(name for name, used in unsupported.items() if used) + " yet")
        # The kernel's layout, in place of vLLM's (as its XPU path does):
        # w13 [E, 2I, H] -> [E, H, 2I] (gate | up), w2 [E, H, I] -> [E, I, H].
        layer.w13_weight.data = layer.w13_weight.data.transpose(1, 2).contiguous()
        layer.w2_weight.data = layer.w2_weight.data.transpose(1, 2).contiguous()

    def forward_native(self, layer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       shared_experts=None, shared_experts_input: torch.Tensor | None = None) -> torch.Tensor:
        if shared_experts is not None:  # vLLM's kernels run them beside the routed experts
            shared_experts(shared_experts_input, SharedExpertsOrder.MK_INTERNAL_OVERLAPPED)
        return moe_routed(x, topk_weights, topk_ids, layer.w13_weight, layer.w2_weight)

    def forward_oot(self, *args, **kwargs) -> torch.Tensor:
        return self.forward_native(*args, **kwargs)
