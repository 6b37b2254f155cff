"""SwiGLU's gating, silu(gate) * up, in one pass (the MLP's projections
stay matmuls)."""

from __future__ import annotations

import torch

from .. import kernel as nk
from ._blocks import on_device, reference_autograd, row_block


@nk.jit
def _swiglu(gate, up, out, ROWS: nk.constexpr):
    rows = nk.ds(nk.program_id(0) * ROWS, ROWS)
    g = nk.cast(nk.load(gate[rows, :]), nk.float32)
    u = nk.cast(nk.load(up[rows, :]), nk.float32)
    nk.store(out[rows, :], nk.cast(g * nk.sigmoid(g) * u, out.dtype))


def swiglu_reference(gate, up):
    return (torch.nn.functional.silu(gate.float()) * up.float()).to(gate.dtype)


_swiglu_op = nk.op(
    "neuron_kernels::swiglu", _swiglu, outputs=lambda gate, up: [(gate.shape, gate.dtype)],
    grid=lambda gate, up: (gate.shape[0] // row_block(gate.shape[0]),),
    constants=lambda gate, up: {"ROWS": row_block(gate.shape[0])},
    **reference_autograd(swiglu_reference, 2))


def swiglu(gate, up):
    """silu(gate) * up, computed in float32."""
    rows = gate.reshape(-1, gate.shape[-1]) if gate.dim() != 2 else gate
    if gate.dim() == 0 or gate.shape != up.shape or not on_device(gate, up) or not row_block(rows.shape[0]):
        return swiglu_reference(gate, up)
    return _swiglu_op(rows, up.reshape(rows.shape)).view(gate.shape)


__all__ = ["swiglu", "swiglu_reference"]
