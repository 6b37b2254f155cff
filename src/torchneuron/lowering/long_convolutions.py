"""Long convolution reductions in blocks: forward and backward.

A convolution sums each output element over its input channels times its
window (C_in x kernel elements), and IREE's llvm-cpu codegen accumulates that
sum in order, as it does a matmul's inner dimension (split_k.py): a
[512, 512, 3, 3] convolution was 12x further off float64 than CPU's, and the
census's registry held 11 such convolutions (C_in x kernel 2304-8192) off by
more than the unit stage's tolerance. Here a convolution whose reduction is
longer than LONG runs as convolutions over blocks of its input channels
(slices of the input and the weight), whose results are added: the error
grows with the block's reduction plus the number of blocks. As one grouped
convolution (weight reordered so that each group makes every output channel)
it was as accurate but IREE ran it about 20x slower (a [512, 512, 3, 3]
one: 740 ms against 31-34 ms whole); the slices ran as fast as the whole one.

The backward pass has two more: the input's gradient sums over output
channels times the window (in blocks of output channels, the same way), and
the weight's and bias's gradients sum over the batch times every output
position (12800 in a textnet layer: 2.8x CPU's mean error). The weight's gradient
is computed over blocks of output rows, each with the rows of the input its
windows read. (The bias's gradient stays in the whole op: summed apart, by
long_sums.py, it made a [8, 64, 56, 56] backward 20% slower.)

Non-transposed, ungrouped float32/float64 convolutions of static shape only.
"""

from __future__ import annotations

import math

import torch

aten = torch.ops.aten

LONG = 1024
BLOCK = 256
# Blocks are convolutions of their own in the graph, each compiled: 16 made a
# [512, 512, 3, 3] convolution's first compile 3.1 s (1.5 s whole), 8 2.3 s.
MOST = 8


def _count(channels: int, window: int) -> int:
    """Blocks to split `channels` input channels into: the largest divisor
    of `channels` that leaves reductions of about BLOCK elements, at most MOST."""
    for count in range(min(channels * window // BLOCK, channels, MOST), 1, -1):
        if channels % count == 0:
            return count
    return 1


def _plain(transposed, groups, *tensors) -> bool:
    return (not transposed and groups == 1 and tensors[0].dtype in (torch.float32, torch.float64)
            and all(t.dtype == tensors[0].dtype for t in tensors)
            and all(isinstance(n, int) for t in tensors for n in t.shape))


def convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    if not _plain(transposed, groups, x, weight):
        return NotImplemented
    channels, window = x.shape[1], math.prod(weight.shape[2:])
    if channels * window <= LONG:
        return NotImplemented
    count = _count(channels, window)
    if count < 2:
        return NotImplemented
    size = channels // count
    total = None
    for start in range(0, channels, size):
        part = aten.convolution.default(aten.slice.Tensor(x, 1, start, start + size),
                                        aten.slice.Tensor(weight, 1, start, start + size), None, stride, padding,
                                        dilation, False, output_padding, 1)
        total = part if total is None else aten.add.Tensor(total, part)
    if bias is not None:
        total = aten.add.Tensor(total, aten.reshape.default(bias, [1, weight.shape[0]] + [1] * (weight.dim() - 2)))
    return total


def convolution_backward(grad, x, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups,
                         output_mask):
    op = aten.convolution_backward.default
    if not _plain(transposed, groups, grad, x, weight):
        return NotImplemented
    positions = math.prod(grad.shape) // grad.shape[1]
    window = math.prod(weight.shape[2:])
    long_input = output_mask[0] and weight.shape[0] * window > LONG and _count(weight.shape[0], window) > 1
    long_weight = output_mask[1] and positions > LONG and _row_blocks(grad) is not None
    if not (long_input or long_weight):
        return NotImplemented
    rest = [output_mask[0] and not long_input, output_mask[1] and not long_weight, output_mask[2]]
    grads = list(op(grad, x, weight, bias_sizes, stride, padding, dilation, False, output_padding, 1, rest)
                 if any(rest) else (None, None, None))
    if long_input:
        grads[0] = _input_grad_in_blocks(grad, x, weight, stride, padding, dilation, output_padding)
    if long_weight:
        grads[1] = _weight_grad_in_blocks(grad, x, weight, stride, padding, dilation, output_padding)
    return tuple(grads)


def _input_grad_in_blocks(grad, x, weight, stride, padding, dilation, output_padding):
    outputs = weight.shape[0]
    size = outputs // _count(outputs, math.prod(weight.shape[2:]))
    total = None
    for start in range(0, outputs, size):
        part = aten.convolution_backward.default(
            aten.slice.Tensor(grad, 1, start, start + size), x, aten.slice.Tensor(weight, 0, start, start + size),
            None, stride, padding, dilation, False, output_padding, 1, [True, False, False])[0]
        total = part if total is None else aten.add.Tensor(total, part)
    return total


def _row_blocks(grad):
    """Output rows (the first spatial dimension) per block of the weight's
    gradient, about BLOCK positions each and at most MOST blocks; None when
    that leaves fewer than two."""
    if grad.dim() < 3:
        return None
    rows = grad.shape[2]
    per_row = grad.shape[0] * math.prod(grad.shape[3:])
    size = max(-(-BLOCK // per_row), -(-rows // MOST))
    return size if size < rows else None


def _weight_grad_in_blocks(grad, x, weight, stride, padding, dilation, output_padding):
    n = weight.dim() - 2

    def per_dim(values):
        values = list(values)
        return values * n if len(values) == 1 else values

    stride, padding, dilation = per_dim(stride), per_dim(padding), per_dim(dilation)
    # The input padded along the rows, so that each block reads a plain slice.
    padded = aten.constant_pad_nd.default(x, [0, 0] * (n - 1) + [padding[0], padding[0]], 0.0)
    reach = dilation[0] * (weight.shape[2] - 1) + 1
    size, rows = _row_blocks(grad), grad.shape[2]
    total = None
    for start in range(0, rows, size):
        stop = min(rows, start + size)
        part = aten.convolution_backward.default(
            aten.slice.Tensor(grad, 2, start, stop),
            aten.slice.Tensor(padded, 2, start * stride[0], (stop - 1) * stride[0] + reach), weight, None,
            stride, [0] + padding[1:], dilation, False, output_padding, 1, [False, True, False])[1]
        total = part if total is None else aten.add.Tensor(total, part)
    return total


def rules() -> dict:
    return {aten.convolution.default: convolution, aten.convolution_backward.default: convolution_backward}
