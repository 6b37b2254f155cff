"""A convolution's backward as plain convolutions and batched matrix products.

torch-mlir lowers `convolution_backward` itself into convolutions IREE's CPU
codegen runs badly: a [8, 64, 56, 56] x [64, 64, 3, 3] backward took 380-480
ms where its forward takes 13-16 ms (CPU eager: 13-20 ms for the backward),
and a transposed convolution's backward it does not lower at all. Here:

- the input's gradient is the forward convolution of the gradient (zeros
  between its elements for a stride, padded explicitly) with the weight
  flipped and its channel axes swapped: the fast plain convolution, and
  long_convolutions.py splits it where its reduction is long;
- the weight's gradient is a batched matrix product of the gradient with the
  input's windows (im2col, gathered as strided slices), summed over the batch:
  split_k.py blocks its long reduction over output positions;
- the bias's gradient is a sum (long_sums.py);
- a transposed convolution's gradients are the same ops with the roles of
  input and gradient swapped, and a grouped transposed convolution's forward
  (which torch-mlir does not lower) is the plain one's input gradient.

Float32/float64 of static shape; other calls keep torch-mlir's lowering.
"""

from __future__ import annotations

import math

import torch

from . import tensor_ops
from .windows import LIMIT, per_dim, windows

aten = torch.ops.aten

def _supported(*tensors) -> bool:
    return (tensors[0].dtype in (torch.float32, torch.float64) and all(t.dtype == tensors[0].dtype for t in tensors)
            and all(isinstance(n, int) for t in tensors for n in t.shape))


def convolution_backward(grad, x, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups,
                         output_mask):
    if not _supported(grad, x, weight):
        return NotImplemented
    n = x.dim() - 2
    stride, padding, dilation = per_dim(stride, n), per_dim(padding, n), per_dim(dilation, n)
    if transposed:
        grads = _transposed(grad, x, weight, stride, padding, dilation, per_dim(output_padding, n), groups,
                            output_mask)
    else:
        grads = [
            _input_grad(grad, x.shape, weight, stride, padding, dilation, groups) if output_mask[0] else None,
            _weight_grad(grad, x, weight.shape, stride, padding, dilation, groups) if output_mask[1] else None,
        ]
    if not output_mask[2] and all(grads[i] is NotImplemented for i in range(2) if output_mask[i]):
        return NotImplemented
    # What is not computed here (NotImplemented) the whole op computes.
    rest = [g is NotImplemented for g in grads] + [False]
    if any(rest):
        whole = aten.convolution_backward.default(grad, x, weight, bias_sizes, stride, padding, dilation, transposed,
                                                  output_padding, groups, rest)
        grads = [whole[i] if rest[i] else g for i, g in enumerate(grads)]
    bias = aten.sum.dim_IntList(grad, [0] + list(range(2, grad.dim())), False) if output_mask[2] else None
    return grads[0], grads[1], bias


def _input_grad(grad, input_shape, weight, stride, padding, dilation, groups):
    """The gradient, zeros between its elements for the stride, padded so that
    a stride-1 convolution with the flipped, channel-swapped weight gives the
    input's size."""
    n = weight.dim() - 2
    kernel = list(weight.shape[2:])
    reach = [dilation[i] * (kernel[i] - 1) for i in range(n)]
    if any(padding[i] > reach[i] for i in range(n)):
        # padding the windows never reach: the padded input's gradient, cut
        padded_shape = list(input_shape[:2]) + [input_shape[2 + i] + 2 * padding[i] for i in range(n)]
        whole = _input_grad(grad, padded_shape, weight, stride, [0] * n, dilation, groups)
        for i in range(n):
            whole = aten.slice.Tensor(whole, 2 + i, padding[i], padding[i] + input_shape[2 + i])
        return whole
    spread = _spread(grad, stride)
    pads = []
    for i in reversed(range(n)):
        before = reach[i] - padding[i]
        # rows of the input the forward's windows never reached get no gradient
        after = input_shape[2 + i] + reach[i] - spread.shape[2 + i] - before
        pads += [before, after]
    padded = aten.constant_pad_nd.default(spread, pads, 0.0)
    outputs, per_group = weight.shape[0], weight.shape[1]
    # [O, C/g, k] -> [C, O/g, k], flipped: group by group, output and input channels swapped
    swapped = aten.reshape.default(
        aten.transpose.int(aten.reshape.default(weight, [groups, outputs // groups, per_group] + kernel), 1, 2),
        [groups * per_group, outputs // groups] + kernel)
    flipped = aten.flip.default(swapped, list(range(2, 2 + n)))
    return aten.convolution.default(padded, flipped, None, [1] * n, [0] * n, dilation, False, [0] * n, groups)


def _spread(grad, stride):
    """grad with stride - 1 zeros between neighbours along each spatial dim."""
    for i, s in enumerate(stride):
        if s == 1:
            continue
        d = 2 + i
        size = grad.shape[d]
        spaced = aten.constant_pad_nd.default(aten.unsqueeze.default(grad, d + 1),
                                              [0, 0] * (grad.dim() - d - 1) + [0, s - 1], 0.0)
        shape = list(grad.shape)
        shape[d] = size * s
        grad = aten.slice.Tensor(aten.reshape.default(spaced, shape), d, 0, (size - 1) * s + 1)
    return grad


def _weight_grad(grad, x, weight_shape, stride, padding, dilation, groups):
    kernel = list(weight_shape[2:])
    out_sizes = list(grad.shape[2:])
    batch, channels, window, positions = x.shape[0], x.shape[1], math.prod(kernel), math.prod(out_sizes)
    if batch * channels * window * positions > LIMIT:
        return NotImplemented
    outputs = weight_shape[0]
    cols = windows(x, kernel, stride, padding, dilation, out_sizes)  # [N, C, K, P]
    # per sample and group: [O/g, P] @ [P, C/g * K], summed over the samples
    cols = aten.reshape.default(cols, [batch * groups, channels // groups * window, positions])
    rows = aten.reshape.default(grad, [batch * groups, outputs // groups, positions])
    products = aten.bmm.default(rows, aten.transpose.int(cols, 1, 2))
    total = aten.sum.dim_IntList(
        aten.reshape.default(products, [batch, groups, outputs // groups, channels // groups * window]), [0], False)
    return aten.reshape.default(total, list(weight_shape))


def _transposed(grad, x, weight, stride, padding, dilation, output_padding, groups, output_mask):
    """A transposed convolution is the plain one's input gradient: its input's
    gradient is the plain convolution of the gradient with the same weight,
    its weight's gradient the plain convolution's weight gradient with input
    and gradient swapped."""
    n = x.dim() - 2
    if any(output_padding[i] >= stride[i] for i in range(n)):
        # the plain convolution would have more positions than the input
        return [NotImplemented if output_mask[i] else None for i in range(2)]
    return [
        # exact_extent: the input padded and cut where the last window stops short
        tensor_ops.convolution_exact_extent(grad, weight, None, stride, padding, dilation, False, [0] * n, groups)
        if output_mask[0] else None,
        _weight_grad(x, grad, weight.shape, stride, padding, dilation, groups) if output_mask[1] else None,
    ]


def grouped_transposed_convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    """A grouped transposed convolution's forward, which torch-mlir does not
    lower (a collapse_shape of the wrong rank): the input gradient of the plain
    convolution with the same weight, at the transposed one's output size."""
    if not transposed or groups == 1 or not _supported(x, weight):
        return NotImplemented
    n = x.dim() - 2
    stride, padding, dilation = per_dim(stride, n), per_dim(padding, n), per_dim(dilation, n)
    output_padding = per_dim(output_padding, n)
    kernel = weight.shape[2:]
    sizes = [(x.shape[2 + i] - 1) * stride[i] - 2 * padding[i] + dilation[i] * (kernel[i] - 1) + output_padding[i] + 1
             for i in range(n)]
    out = _input_grad(x, [x.shape[0], weight.shape[1] * groups] + sizes, weight, stride, padding, dilation, groups)
    if bias is not None:
        out = aten.add.Tensor(out, aten.reshape.default(bias, [1, -1] + [1] * n))
    return out


def rules() -> dict:
    return {aten.convolution_backward.default: convolution_backward}
