"""A convolution's windows (im2col) as strided slices, for lowering
convolutions and their gradients to batched matrix products."""

from __future__ import annotations

import math

import torch

aten = torch.ops.aten

LIMIT = 1 << 26  # elements of gathered windows (256 MiB of float32): larger keep the convolution whole


def per_dim(values, n: int) -> list:
    values = list(values)
    return values * n if len(values) == 1 else values


def output_sizes(x, kernel, stride, padding, dilation) -> list:
    return [(x.shape[2 + i] + 2 * padding[i] - dilation[i] * (k - 1) - 1) // stride[i] + 1
            for i, k in enumerate(kernel)]


def windows(x, kernel, stride, padding, dilation, out_sizes):
    """x's windows, [N, C, K, P] (K the kernel's offsets, P the output
    positions): one strided slice of the padded input per kernel offset."""
    padded = padded_input(x, padding)
    slices = [tap_slice(padded, offset, stride, dilation, out_sizes) for offset in kernel_offsets(kernel)]
    stacked = aten.stack.default(slices, 2)
    return aten.reshape.default(stacked, [x.shape[0], x.shape[1], len(slices), math.prod(out_sizes)])


def padded_input(x, padding):
    """x with `padding` zeros on both sides of each spatial dimension."""
    pads = []
    for i in reversed(range(len(padding))):
        pads += [padding[i], padding[i]]
    return aten.constant_pad_nd.default(x, pads, 0.0) if any(padding) else x


def tap_slice(padded, offset, stride, dilation, out_sizes):
    """The elements of the padded input one kernel offset meets, [N, C, *out_sizes]."""
    part = padded
    for i in range(len(offset)):
        start = offset[i] * dilation[i]
        part = aten.slice.Tensor(part, 2 + i, start, start + (out_sizes[i] - 1) * stride[i] + 1, stride[i])
    return part


def kernel_offsets(kernel):
    offsets = [[]]
    for k in kernel:
        offsets = [o + [j] for o in offsets for j in range(k)]
    return offsets
