"""CPU answers for the fused LSTM cell PyTorch sends accelerators
(lowering/rules/rnn_cells.py): it has kernels on CUDA only. The answers come from
CPU's own lstm_cell and autograd, not from the formulas the lowering uses."""

from __future__ import annotations

import torch


def activations(gates):
    """The forward's workspace: gates [i, f, g, o] activated."""
    i, f, g, o = gates.chunk(4, 1)
    return torch.cat([i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()], 1)


def _cpu_cell(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    """CPU's lstm_cell fed the two gate tensors as its input through identity
    weights (exact in float32), with no hidden state of its own."""
    batch, four = input_gates.shape
    eye = torch.eye(four, dtype=input_gates.dtype)
    zeros = input_gates.new_zeros
    return torch.lstm_cell(torch.cat([input_gates, hidden_gates], 1), (zeros(batch, four // 4), cx),
                           torch.cat([eye, eye], 1), zeros(four, four // 4), input_bias, hidden_bias)


def fused_lstm_cell(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    hy, cy = _cpu_cell(input_gates, hidden_gates, cx, input_bias, hidden_bias)
    gates = input_gates + hidden_gates
    for bias in (input_bias, hidden_bias):
        if bias is not None:
            gates = gates + bias
    return hy, cy, activations(gates)


def fused_lstm_cell_backward(grad_hy, grad_cy, cx, cy, workspace, has_bias):
    """Gradients of CPU's lstm_cell with respect to its gates and cell state,
    at the gates whose activations are the workspace."""
    i, f, g, o = workspace.chunk(4, 1)
    gates = torch.cat([torch.logit(i), torch.logit(f), torch.atanh(g), torch.logit(o)], 1)
    gates, cell = gates.detach().requires_grad_(), cx.detach().clone().requires_grad_()
    with torch.enable_grad():
        hy, new_cy = _cpu_cell(gates, torch.zeros_like(gates), cell)
        pairs = [(out, grad) for out, grad in ((hy, grad_hy), (new_cy, grad_cy)) if grad is not None]
        grad_gates, grad_cx = torch.autograd.grad([p[0] for p in pairs], [gates, cell], [p[1] for p in pairs])
    return grad_gates, grad_cx, grad_gates.sum(0) if has_bias else None


def make_state_consistent(cpu_args, dev_args) -> None:
    """A backward's (cx, cy, workspace) as one forward leaves them: the
    workspace activated gates, cy = f * cx + i * g (random ones are not)."""
    cx, workspace = cpu_args[2], cpu_args[4]
    settled = activations(workspace)
    i, f, g, _ = settled.chunk(4, 1)
    for args in (cpu_args, dev_args):
        args[4].copy_(settled)
        args[3].copy_(f * cx + i * g)
