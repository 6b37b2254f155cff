"""Convolutions IREE's CPU codegen runs slowly, as batched matrix products.

IREE ran 1-D convolutions 12-40x slower than CPU eager (an [8, 512, 200] *
[512, 512, 3] one 309 ms, CPU 7.9 ms) and 1x1 convolutions 3-5x slower. As a
product of the weight with the input's windows (windows.py; a 1x1
convolution's windows are the input itself) they take 32.6 ms and 2-4x CPU's
time, and split_k.py blocks their long reductions. 2-D and 3-D convolutions
with larger kernels stay whole: as products a [8, 64, 56, 56] * [64, 64, 3,
3] one took 46 ms against 14 ms whole. Ungrouped float32/float64 of static
shape only.
"""

from __future__ import annotations

import math

import torch

from .windows import LIMIT, output_sizes, per_dim, windows

aten = torch.ops.aten


def convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    if (transposed or groups != 1 or x.dtype not in (torch.float32, torch.float64) or weight.dtype != x.dtype
            or not all(isinstance(n, int) for t in (x, weight) for n in t.shape)):
        return NotImplemented
    n = x.dim() - 2
    kernel = list(weight.shape[2:])
    if n != 1 and any(k != 1 for k in kernel):
        return NotImplemented
    stride, padding, dilation = per_dim(stride, n), per_dim(padding, n), per_dim(dilation, n)
    sizes = output_sizes(x, kernel, stride, padding, dilation)
    batch, channels, outputs = x.shape[0], x.shape[1], weight.shape[0]
    window, positions = math.prod(kernel), math.prod(sizes)
    if min(sizes) <= 0 or batch * channels * window * positions > LIMIT:
        return NotImplemented
    if window == 1 and not any(padding) and all(s == 1 for s in stride):
        cols = aten.reshape.default(x, [batch, channels, positions])
    else:
        cols = aten.reshape.default(windows(x, kernel, stride, padding, dilation, sizes),
                                    [batch, channels * window, positions])
    weights = aten.expand.default(aten.reshape.default(weight, [1, outputs, channels * window]),
                                  [batch, outputs, channels * window])
    out = aten.reshape.default(aten.bmm.default(weights, cols), [batch, outputs] + sizes)
    if bias is not None:
        out = aten.add.Tensor(out, aten.reshape.default(bias, [1, outputs] + [1] * n))
    return out
