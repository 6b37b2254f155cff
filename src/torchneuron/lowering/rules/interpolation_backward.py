"""The backward of linear, bilinear and trilinear upsampling as device ops.

PyTorch has CPU and CUDA kernels for `upsample_*linear*_backward` and no
decomposition, and torch-mlir does not lower them, so they ran on the host
(efficientloftr's and the detectors' feature pyramids). Upsampling is
separable: each output index along a dimension reads two input indices with
weights that depend only on the sizes. Its backward adds the gradient back
along each dimension in turn: each input index gathers the weighted
gradients of the few output indices that read it (constant index and weight
lists per dimension).

The indices and weights are computed here as PyTorch's CPU kernel computes
them (`compute_source_index_and_lambda` in ATen's UpSample.h), in its
arithmetic type (float32, or float64 for double), so every gradient goes to
the same input element as on CPU.
"""

from __future__ import annotations

import numpy as np
import torch

aten = torch.ops.aten


def _source_indices(in_size: int, out_size: int, align_corners: bool, scale, exact: type):
    """For each output index: the two input indices it reads and their weights,
    as PyTorch's CPU kernel computes them in `exact` (np.float32 or np.float64)."""
    if in_size == out_size:  # the kernel copies: one index, weight 1
        same = list(range(out_size))
        return same, same, [1.0] * out_size, [0.0] * out_size
    if align_corners:
        ratio = exact(in_size - 1) / exact(out_size - 1) if out_size > 1 else exact(0)
    elif scale is not None and scale > 0:
        ratio = exact(1.0 / scale)
    else:
        ratio = exact(in_size) / exact(out_size)
    first, second, weight_first, weight_second = [], [], [], []
    for o in range(out_size):
        if align_corners:
            real = ratio * exact(o)
        else:
            real = max(ratio * (exact(o) + exact(0.5)) - exact(0.5), exact(0))
        index = min(int(np.floor(real)), in_size - 1)
        weight = min(max(real - exact(index), exact(0)), exact(1))
        first.append(index)
        second.append(index + (1 if index < in_size - 1 else 0))
        weight_first.append(float(exact(1) - weight))
        weight_second.append(float(weight))
    return first, second, weight_first, weight_second


def _add_back(grad, dim: int, in_size: int, indices, dtype):
    """The transpose of interpolating along `dim`: each input slice gets the
    weighted gradients of the output slices that read it. A gather, not a
    scatter (IREE's scatter ran 10-25x slower than CPU's kernel): input slice
    i sums K gathered output slices, padded with a slice of zeros."""
    first, second, weight_first, weight_second = indices
    out_size = grad.shape[dim]
    readers: list = [[] for _ in range(in_size)]
    for o in range(out_size):
        readers[first[o]].append((o, weight_first[o]))
        readers[second[o]].append((o, weight_second[o]))
    k = max(1, max(len(r) for r in readers))
    padded = [r + [(out_size, 0.0)] * (k - len(r)) for r in readers]  # out_size: the zero slice
    index = torch.tensor([o for r in padded for o, _ in r], device=grad.device)
    weight_shape = [1] * (grad.dim() + 1)
    weight_shape[dim], weight_shape[dim + 1] = in_size, k
    weight = torch.tensor([w for r in padded for _, w in r], dtype=dtype, device=grad.device).reshape(weight_shape)
    zeros = grad.new_zeros(grad.shape[:dim] + (1,) + grad.shape[dim + 1:])
    gathered = torch.index_select(torch.cat([grad, zeros], dim), dim, index)
    gathered = gathered.reshape(grad.shape[:dim] + (in_size, k) + grad.shape[dim + 1:])
    return (gathered * weight).sum(dim + 1)


def _linear_backward(spatial: int):
    def backward(grad_output, output_size, input_size, align_corners, *scales):
        scales = list(scales) + [None] * (spatial - len(scales))
        opmath = torch.float64 if grad_output.dtype == torch.float64 else torch.float32
        exact = np.float64 if opmath == torch.float64 else np.float32
        grad = grad_output.to(opmath)
        for k in reversed(range(spatial)):
            dim = grad.dim() - spatial + k
            in_size, out_size = input_size[2 + k], output_size[k]
            indices = _source_indices(in_size, out_size, align_corners, scales[k], exact)
            grad = _add_back(grad, dim, in_size, indices, opmath)
        return grad.to(grad_output.dtype)

    return backward


def decompositions() -> dict:
    return {
        aten.upsample_linear1d_backward.default: _linear_backward(1),
        aten.upsample_bilinear2d_backward.default: _linear_backward(2),
        aten.upsample_trilinear3d_backward.default: _linear_backward(3),
    }
