"""Depthwise convolutions on GPU targets as a multiply-add per kernel tap.

IREE 3.13's SPIR-V code for linalg's depthwise convolutions gave wrong values
on lavapipe (1-D and 2-D, any kernel longer than 1: a [2, 16, 12] * [16, 1, 3]
one 7.0 off, VITS's duration predictor and MobileNet's blocks with it). Here
a convolution with one input and one output channel per group is the sum,
over the kernel's offsets, of the padded input's strided slice at that offset
times that tap of each channel's kernel: elementwise work IREE fuses into one
dispatch, with no window tensor gathered. The CPU target keeps its own
lowering.
"""

from __future__ import annotations

import torch

from ..target import gpu_target
from .windows import kernel_offsets, output_sizes, padded_input, per_dim, tap_slice

aten = torch.ops.aten


def convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    channels = x.shape[1] if x.dim() >= 3 else None
    if (not gpu_target() or transposed or groups == 1 or channels != groups or weight.shape[0] != groups
            or weight.shape[1] != 1 or not x.is_floating_point() or weight.dtype != x.dtype
            or not all(isinstance(n, int) for t in (x, weight) for n in t.shape)):
        return NotImplemented
    n = x.dim() - 2
    kernel = list(weight.shape[2:])
    stride, padding, dilation = per_dim(stride, n), per_dim(padding, n), per_dim(dilation, n)
    sizes = output_sizes(x, kernel, stride, padding, dilation)
    if min(sizes) <= 0:
        return NotImplemented
    padded = padded_input(x, padding)
    taps = aten.reshape.default(weight, [groups, -1])  # [C, taps], row-major over the kernel's offsets
    out = None
    for index, offset in enumerate(kernel_offsets(kernel)):
        part = tap_slice(padded, offset, stride, dilation, sizes)
        tap = aten.reshape.default(aten.select.int(taps, 1, index), [1, groups] + [1] * n)
        term = aten.mul.Tensor(part, tap)
        out = term if out is None else aten.add.Tensor(out, term)
    if bias is not None:
        out = aten.add.Tensor(out, aten.reshape.default(bias, [1, groups] + [1] * n))
    return out

