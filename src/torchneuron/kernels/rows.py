"""Softmax and log-softmax over the last dimension, a block of rows per
program."""

from __future__ import annotations

import torch

from .. import kernel as nk
from ._blocks import on_device, reference_autograd, row_block


@nk.jit
def _softmax(x, out, ROWS: nk.constexpr, LOG: nk.constexpr):
    rows = nk.ds(nk.program_id(0) * ROWS, ROWS)
    t = nk.cast(nk.load(x[rows, :]), nk.float32)
    shifted = t - nk.max(t, axis=1, keepdims=True)
    e = nk.exp(shifted)
    total = nk.sum(e, axis=1, keepdims=True)
    y = shifted - nk.log(total) if LOG else e / total
    nk.store(out[rows, :], nk.cast(y, out.dtype))


def softmax_reference(x, log: bool = False):
    return torch.log_softmax(x.float(), -1).to(x.dtype) if log else torch.softmax(x.float(), -1).to(x.dtype)


def log_softmax_reference(x):
    return softmax_reference(x, True)


_softmax_op = nk.op(
    "neuron_kernels::softmax", _softmax, attributes={"log": "bool"},
    outputs=lambda x, log: [(x.shape, x.dtype)],
    grid=lambda x, log: (x.shape[0] // row_block(x.shape[0]),),
    constants=lambda x, log: {"ROWS": row_block(x.shape[0]), "LOG": bool(log)},
    **reference_autograd(softmax_reference, 1))


def _run(x, log):
    rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    if x.dim() == 0 or not on_device(x) or not row_block(rows.shape[0]):
        return softmax_reference(x, log)
    return _softmax_op(rows, log).view(x.shape)


def softmax(x):
    """Softmax over the last dimension, computed in float32."""
    return _run(x, False)


def log_softmax(x):
    """Log-softmax over the last dimension, computed in float32."""
    return _run(x, True)


__all__ = ["log_softmax", "log_softmax_reference", "softmax", "softmax_reference"]
