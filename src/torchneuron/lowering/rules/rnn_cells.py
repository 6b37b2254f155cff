"""The fused RNN cells PyTorch sends accelerators (and only accelerators).

`lstm_cell`/`gru_cell` on a CUDA, XPU or PrivateUse1 tensor call
`_thnn_fused_lstm_cell`/`_thnn_fused_gru_cell` and their backward ops, which
have CUDA kernels only: CPU has none, so the host fallback cannot run them.
These are those kernels' computations, with the same workspace layouts, so
forward and backward compile (or run op by op) on neuron.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


def _gates(input_gates, hidden_gates, input_bias, hidden_bias):
    gates = input_gates + hidden_gates
    if input_bias is not None:
        gates = gates + input_bias
    if hidden_bias is not None:
        gates = gates + hidden_bias
    return gates


def fused_lstm_cell(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    """(hy, cy, workspace); the workspace holds the activated gates [i, f, g, o]."""
    i, f, g, o = _gates(input_gates, hidden_gates, input_bias, hidden_bias).chunk(4, 1)
    i, f, g, o = torch.sigmoid(i), torch.sigmoid(f), torch.tanh(g), torch.sigmoid(o)
    cy = f * cx + i * g
    hy = o * torch.tanh(cy)
    return hy, cy, torch.cat([i, f, g, o], 1)


def fused_lstm_cell_backward(grad_hy, grad_cy, cx, cy, workspace, has_bias):
    """(grad_gates, grad_cx, grad_bias) from the forward's workspace."""
    i, f, g, o = workspace.chunk(4, 1)
    if grad_hy is None:
        grad_hy = torch.zeros_like(cy)
    if grad_cy is None:
        grad_cy = torch.zeros_like(cy)
    tanh_cy = torch.tanh(cy)
    grad_o = grad_hy * tanh_cy * o * (1 - o)
    grad_c = grad_hy * o * (1 - tanh_cy * tanh_cy) + grad_cy
    grad_f = grad_c * cx * f * (1 - f)
    grad_i = grad_c * g * i * (1 - i)
    grad_g = grad_c * i * (1 - g * g)
    grad_gates = torch.cat([grad_i, grad_f, grad_g, grad_o], 1)
    grad_bias = grad_gates.sum(0) if has_bias else None
    return grad_gates, grad_c * f, grad_bias


def fused_gru_cell(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    """(hy, workspace); the workspace holds [r, z, n, hidden n-gate, hx]."""
    if input_bias is not None:
        input_gates = input_gates + input_bias
    if hidden_bias is not None:
        hidden_gates = hidden_gates + hidden_bias
    ir, iz, in_ = input_gates.chunk(3, 1)
    hr, hz, hn = hidden_gates.chunk(3, 1)
    r = torch.sigmoid(ir + hr)
    z = torch.sigmoid(iz + hz)
    n = torch.tanh(in_ + r * hn)
    hy = n + z * (hx - n)
    return hy, torch.cat([r, z, n, hn, hx], 1)


def fused_gru_cell_backward(grad_hy, workspace, has_bias):
    """(grad_input_gates, grad_hidden_gates, grad_hx, grad_input_bias, grad_hidden_bias)."""
    r, z, n, hn, hx = workspace.chunk(5, 1)
    grad_z = grad_hy * (hx - n) * z * (1 - z)
    grad_hx = grad_hy * z
    grad_n = grad_hy * (1 - z) * (1 - n * n)
    grad_hn = grad_n * r
    grad_r = grad_n * hn * r * (1 - r)
    grad_input_gates = torch.cat([grad_r, grad_z, grad_n], 1)
    grad_hidden_gates = torch.cat([grad_r, grad_z, grad_hn], 1)
    if has_bias:
        return grad_input_gates, grad_hidden_gates, grad_hx, grad_input_gates.sum(0), grad_hidden_gates.sum(0)
    return grad_input_gates, grad_hidden_gates, grad_hx, None, None


def decompositions() -> dict:
    return {
        aten._thnn_fused_lstm_cell.default: fused_lstm_cell,
        aten._thnn_fused_lstm_cell_backward_impl.default: fused_lstm_cell_backward,
        aten._thnn_fused_gru_cell.default: fused_gru_cell,
        aten._thnn_fused_gru_cell_backward.default: fused_gru_cell_backward,
    }
