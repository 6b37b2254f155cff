"""Blockwise mixture of experts: tokens gathered by expert into blocks, each
block's expert MLP (silu(x W1) W2) as tiled matmuls in one kernel, and the
results scatter-added back to their tokens with their gate weights.

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
def _experts(x, slots, gates, w1, w2, out, B: nk.constexpr, C: nk.constexpr, BF: nk.constexpr):
    e, b = nk.program_id(0), nk.program_id(1)
    rows = nk.ds(e * C + b * B, B)
    tokens = nk.load(x[nk.load(slots[rows]), :])  # gathered by expert: [B, D]
    acc = nk.zeros((B, x.shape[1]), nk.float32)
    for f in nk.sequential_range(w1.shape[2] // BF):
        h = nk.matmul(tokens, nk.load(w1[e, :, nk.ds(f * BF, BF)]))
        acc += nk.matmul(h * nk.sigmoid(h), nk.load(w2[e, nk.ds(f * BF, BF), :]))
    nk.store(out[rows, :], acc * nk.load(gates[rows])[:, None])


def _experts_reference(x, slots, gates, w1, w2, capacity):
    experts = torch.arange(w1.shape[0], device=x.device).repeat_interleave(capacity)
    tokens = x[slots.long()]
    h = torch.einsum("sd,sdf->sf", tokens, w1[experts])
    return torch.einsum("sf,sfd->sd", torch.nn.functional.silu(h), w2[experts]) * gates[:, None]


_experts_op = nk.op(
    "neuron_kernels::moe_experts", _experts, attributes={"capacity": "int"},
    outputs=lambda x, slots, gates, w1, w2, capacity: [((slots.shape[0], x.shape[1]), torch.float32)],
    grid=lambda x, slots, gates, w1, w2, capacity: (w1.shape[0], capacity // _BLOCK),
    constants=lambda x, slots, gates, w1, w2, capacity: {"B": _BLOCK, "C": capacity, "BF": row_block(w1.shape[2])},
    **reference_autograd(_experts_reference, 5))


def moe_reference(x, router_probs, w1, w2, top_k: int = 2):
    """out[t] = sum over t's top_k experts e of p[t, e] * silu(x[t] W1[e]) W2[e]."""
    weights, experts = router_probs.topk(top_k, dim=-1)
    out = torch.zeros_like(x, dtype=torch.float32)
    for e in range(w1.shape[0]):
        token, slot = (experts == e).nonzero(as_tuple=True)
        if token.numel():
            h = torch.nn.functional.silu(x[token].float() @ w1[e].float()) @ w2[e].float()
            out = out.index_add(0, token, h * weights[token, slot, None].float())
    return out.to(x.dtype)


def moe(x, router_probs, w1, w2, top_k: int = 2):
    """Top-k mixture of SiLU-MLP experts for x [N, D], router_probs [N, E],
    w1 [E, D, F], w2 [E, F, D] (float32, D <= 128)."""
    n, d = x.shape if x.dim() == 2 else (0, 0)
    if (x.dim() != 2 or d > nk.PMAX or w1.dim() != 3 or w1.shape[1] != d or w2.shape != (w1.shape[0], w1.shape[2], d)
            or router_probs.shape != (n, w1.shape[0]) or not on_device(x, router_probs, w1, w2)
            or {x.dtype, w1.dtype, w2.dtype} != {torch.float32}):
        return moe_reference(x, router_probs, w1, w2, top_k)
    n_experts = w1.shape[0]
    weights, experts = router_probs.topk(top_k, dim=-1)
    assigned = experts.reshape(-1)
    order = torch.argsort(assigned, stable=True)
    counts = torch.bincount(assigned, minlength=n_experts)
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


__all__ = ["moe", "moe_reference"]
