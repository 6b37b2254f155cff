"""Cross-entropy over a large vocabulary without the full softmax: each
block of rows streams the vocabulary in blocks, keeping a running max, sum
of exponentials and the target's logit."""

from __future__ import annotations

import torch

from .. import kernel as nk
from ._blocks import on_device, reference_autograd, row_block

_VOCAB_BLOCK = 8192
_ROWS = 64  # blocks of rows streaming the vocabulary in large blocks (measured best on 2 cores)


@nk.jit
def _cross_entropy(logits, target, out, ROWS: nk.constexpr, BV: nk.constexpr):
    rows = nk.ds(nk.program_id(0) * ROWS, ROWS)
    wanted = nk.load(target[rows, :])  # [ROWS, 1] int32
    m = nk.full((ROWS, 1), float("-inf"), nk.float32)
    total = nk.zeros((ROWS, 1), nk.float32)
    picked = nk.zeros((ROWS, 1), nk.float32)
    for j in nk.sequential_range(logits.shape[1] // BV):
        t = nk.cast(nk.load(logits[rows, nk.ds(j * BV, BV)]), nk.float32)
        m_new = nk.maximum(m, nk.max(t, axis=1, keepdims=True))
        total[...] = total * nk.exp(m - m_new) + nk.sum(nk.exp(t - m_new), axis=1, keepdims=True)
        m[...] = m_new
        columns = nk.arange(BV)[None, :] + j * BV
        picked[...] = picked + nk.sum(nk.where(columns == wanted, t, 0.0), axis=1, keepdims=True)
    nk.store(out[rows, :], m + nk.log(total) - picked)


def _vocab_block(vocab: int) -> int:
    for block in range(min(vocab, _VOCAB_BLOCK), 0, -1):
        if vocab % block == 0:
            return block
    return 1


def _losses_reference(logits, target):
    return torch.nn.functional.cross_entropy(logits.float(), target[:, 0].long(), reduction="none")[:, None]


_cross_entropy_op = nk.op(
    "neuron_kernels::cross_entropy", _cross_entropy,
    outputs=lambda logits, target: [((logits.shape[0], 1), torch.float32)],
    grid=lambda logits, target: (logits.shape[0] // row_block(logits.shape[0], _ROWS),),
    constants=lambda logits, target: {"ROWS": row_block(logits.shape[0], _ROWS), "BV": _vocab_block(logits.shape[1])},
    **reference_autograd(_losses_reference, 2))


def cross_entropy_reference(logits, target, ignore_index: int = -100, reduction: str = "mean"):
    return torch.nn.functional.cross_entropy(logits.float(), target, ignore_index=ignore_index, reduction=reduction)


def cross_entropy(logits, target, ignore_index: int = -100, reduction: str = "mean"):
    """F.cross_entropy(logits [N, V], target [N]) in float32, reduction
    "mean", "sum" or "none", targets equal to ignore_index left out."""
    if (logits.dim() != 2 or target.shape != logits.shape[:1] or not on_device(logits)
            or target.device != logits.device or not row_block(logits.shape[0]) or reduction not in ("mean", "sum", "none")):
        return cross_entropy_reference(logits, target, ignore_index, reduction)
    losses = _cross_entropy_op(logits, target.to(torch.int32)[:, None].contiguous())[:, 0]
    kept = target != ignore_index
    losses = torch.where(kept, losses, torch.zeros((), dtype=losses.dtype, device=losses.device))
    if reduction == "none":
        return losses
    return losses.sum() if reduction == "sum" else losses.sum() / kept.sum()


__all__ = ["cross_entropy", "cross_entropy_reference"]
