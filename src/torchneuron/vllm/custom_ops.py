"""vLLM's C++ operators a neuron step meets, answered in PyTorch ops.

vLLM calls some small operators of its own C++ extensions directly (not
through a CustomOp layer); its CPU build leaves out the ones only its GPU
kernels use. These are defined here, in vLLM's own namespaces, for neuron
tensors, with the semantics of vLLM's CUDA kernels. Only what the models
served here meet: MoE routing's top-k of a softmax.
"""

from __future__ import annotations

import torch

_library = None


def register() -> None:
    """Define the operators vLLM's build does not (idempotent)."""
    global _library
    if _library is not None or hasattr(torch.ops._moe_C, "topk_softmax"):
        return
    _library = torch.library.Library("_moe_C", "FRAGMENT")
    _library.define("topk_softmax(Tensor(a!) topk_weights, Tensor(b!) topk_ids, Tensor(c!) token_expert_indices, "
                    "Tensor gating_output, bool renormalize, Tensor? e_score_correction_bias=None, "
                    "Tensor? is_padding=None) -> ()")
    _library.impl("topk_softmax", topk_softmax, "PrivateUse1")
    torch.library.register_fake("_moe_C::topk_softmax", lambda *args: None, lib=_library)


def topk_softmax(topk_weights: torch.Tensor, topk_ids: torch.Tensor, token_expert_indices: torch.Tensor,
                 gating_output: torch.Tensor, renormalize: bool, e_score_correction_bias: torch.Tensor | None = None,
                 is_padding: torch.Tensor | None = None) -> None:
    """Each token's top-k experts by softmax(gating_output) (plus the
    correction bias, for choosing only) and their probabilities,
    renormalized to sum to 1 if asked; token_expert_indices[t, j] = j *
    tokens + t. Padded tokens (is_padding) are routed like any other: their
    outputs are dropped."""
    tokens, k = topk_ids.shape
    scores = torch.softmax(gating_output.float(), dim=-1)
    chosen = scores if e_score_correction_bias is None else scores + e_score_correction_bias.float()
    ids = chosen.topk(k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    topk_weights.copy_(weights)
    topk_ids.copy_(ids)
    rows = torch.arange(tokens, dtype=torch.int32, device=topk_ids.device)
    token_expert_indices.copy_(torch.arange(k, dtype=torch.int32, device=topk_ids.device)[None, :] * tokens
                               + rows[:, None])
