"""Long convolution reductions in blocks of input channels.

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

A convolution's backward is plain convolutions and batched products
(convolution_backward.py), which this rule and split_k.py block in turn.

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
