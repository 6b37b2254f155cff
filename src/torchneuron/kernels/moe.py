"""Blockwise mixture of experts: tokens gathered by expert into blocks, each
block's expert MLP (silu(x W1) W2, or gated: silu(x W1g) * (x W1u) W2, the
SwiGLU experts of Mixtral, Qwen-MoE and DeepSeek) as tiled matmuls in one
kernel, and the results scatter-added back to their tokens with their gate
weights. `moe` routes (top-k of the router's probabilities);
`moe_routed` takes routing already done (vLLM's fused MoE layer).

Routing (top-k, sorting assignments by expert) runs as PyTorch ops; each
expert's slots are padded to a multiple of the block with a zero-weight
token, and the capacity is the busiest expert's count (one host read), so
no token is dropped and the result is the reference's.
"""

from __future__ import annotations

import torch

from .. import kernel as nk
from ._blocks import on_device, reference_autograd, row_block

_BLOCK = 32  # slots (tokens) per program


@nk.jit
def _experts(x, slots, gates, w1, w2, out, B: nk.constexpr, C: nk.constexpr, BF: nk.constexpr,
             GATED: nk.constexpr):
    e, b = nk.program_id(0), nk.program_id(1)
    rows = nk.ds(e * C + b * B, B)
    tokens = nk.load(x[nk.load(slots[rows]), :])  # gathered by expert: [B, D]
    acc = nk.zeros((B, x.shape[1]), nk.float32)
    for f in nk.sequential_range(w2.shape[1] // BF):
        h = nk.matmul(tokens, nk.load(w1[e, :, nk.ds(f * BF, BF)]))
        h = h * nk.sigmoid(h)
        if GATED:  # w1's second half is the up projection
            h = h * nk.matmul(tokens, nk.load(w1[e, :, nk.ds(w2.shape[1] + f * BF, BF)]))
        acc += nk.matmul(h, nk.load(w2[e, nk.ds(f * BF, BF), :]))
    nk.store(out[rows, :], acc * nk.load(gates[rows])[:, None])


def _activation(h, width: int):
    """silu(h), or silu(gate) * up when h is [gate | up], twice `width` wide."""
    if h.shape[-1] == 2 * width:
        gate, up = h.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up
    return torch.nn.functional.silu(h)


def _experts_reference(x, slots, gates, w1, w2, capacity):
    experts = torch.arange(w1.shape[0], device=x.device).repeat_interleave(capacity)
    h = _activation(torch.einsum("sd,sdf->sf", x[slots.long()], w1[experts]), w2.shape[1])
    return torch.einsum("sf,sfd->sd", h, w2[experts]) * gates[:, None]


_experts_op = nk.op(
    "neuron_kernels::moe_experts", _experts, attributes={"capacity": "int"},
    outputs=lambda x, slots, gates, w1, w2, capacity: [((slots.shape[0], x.shape[1]), torch.float32)],
    grid=lambda x, slots, gates, w1, w2, capacity: (w1.shape[0], capacity // _BLOCK),
    constants=lambda x, slots, gates, w1, w2, capacity: {
        "B": _BLOCK, "C": capacity, "BF": row_block(w2.shape[1]), "GATED": w1.shape[2] == 2 * w2.shape[1]},
    **reference_autograd(_experts_reference, 5))


def moe_routed_reference(x, weights, experts, w1, w2):
    """out[t] = sum over j of weights[t, j] * MLP_{experts[t, j]}(x[t]), the
    MLP silu(x W1[e]) W2[e], or silu(x W1[e][:, :F]) * (x W1[e][:, F:]) W2[e]
    when W1 is [E, D, 2F] for W2 [E, F, D]."""
    out = torch.zeros_like(x, dtype=torch.float32)
    for e in range(w1.shape[0]):
        token, slot = (experts == e).nonzero(as_tuple=True)
        if token.numel():
            h = _activation(x[token].float() @ w1[e].float(), w2.shape[1]) @ w2[e].float()
            out = out.index_add(0, token, h * weights[token, slot, None].float())
    return out.to(x.dtype)


def moe_reference(x, router_probs, w1, w2, top_k: int = 2):
    """out[t] = sum over t's top_k experts e of p[t, e] * silu(x[t] W1[e]) W2[e]
    (gated as moe_routed_reference's when W1 is twice as wide)."""
    weights, experts = router_probs.topk(top_k, dim=-1)
    return moe_routed_reference(x, weights, experts, w1, w2)


def moe(x, router_probs, w1, w2, top_k: int = 2):
    """Top-k mixture of SiLU-MLP experts for x [N, D], router_probs [N, E],
    w1 [E, D, F] (or [E, D, 2F], gate | up, for SwiGLU experts), w2 [E, F, D]
    (float32, D <= 128)."""
    if router_probs.dim() != 2:
        return moe_reference(x, router_probs, w1, w2, top_k)
    weights, experts = router_probs.topk(top_k, dim=-1)
    return moe_routed(x, weights, experts, w1, w2)


def moe_routed(x, weights, experts, w1, w2):
    """The experts of routing already done: x [N, D], weights and experts
    [N, K] (each token's K experts and their gate weights), w1 and w2 as
    moe's."""
    n, d = x.shape if x.dim() == 2 else (0, 0)
    if (x.dim() != 2 or d > nk.PMAX or w1.dim() != 3 or w1.shape[1] != d or w2.dim() != 3
            or w2.shape[0] != w1.shape[0] or w2.shape[2] != d or w1.shape[2] not in (w2.shape[1], 2 * w2.shape[1])
            or weights.shape != experts.shape or weights.shape[:1] != (n,) or not on_device(x, weights, w1, w2)
            or {x.dtype, w1.dtype, w2.dtype} != {torch.float32} or experts.device != x.device):
        return moe_routed_reference(x, weights, experts, w1, w2)
    n_experts = w1.shape[0]
    top_k = experts.shape[1]
    assigned = experts.reshape(-1).long()
    order = torch.argsort(assigned, stable=True)
    # (bincount would read the largest id back first; the length is known)
    counts = torch.zeros(n_experts, dtype=torch.int64, device=x.device).index_add_(0, assigned, torch.ones_like(assigned))
    capacity = max(1, -(-int(counts.max()) // _BLOCK)) * _BLOCK  # the busiest expert's slots (a host read)
    starts = torch.cumsum(counts, 0) - counts
    sorted_experts = assigned[order]
    rank = torch.arange(assigned.numel(), device=x.device)
    slot = sorted_experts * capacity + (rank - starts[sorted_experts])
    slots = torch.zeros(n_experts * capacity, dtype=torch.int32, device=x.device)
    gates = torch.zeros(n_experts * capacity, dtype=torch.float32, device=x.device)
    token = torch.arange(n, device=x.device).repeat_interleave(top_k)[order]
    slots = slots.index_put((slot,), token.to(torch.int32))
    gates = gates.index_put((slot,), weights.reshape(-1)[order].float())
    results = _experts_op(x, slots, gates, w1, w2, capacity)
    # Scatter-add back to the tokens; padding slots carry gate 0.
    return torch.zeros_like(x).index_add(0, slots.long(), results)


__all__ = ["moe", "moe_reference", "moe_routed", "moe_routed_reference"]
