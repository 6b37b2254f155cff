"""Moments of float32 tensors in float32 on GPU targets.

torch-mlir computes a float32 variance in float64 (its var decomposition
upcasts), which is what PyTorch's CPU kernels do (at::acc_type<float> on CPU
is double), and stays so on the CPU target. On a GPU target PyTorch's own
kernels accumulate float32 moments in float32 (acc_type<float, is_cuda> is
float), float64 runs at a fraction of float32's rate where it runs at all,
and IREE's SPIR-V code for a float32-to-float64 reduction crashed lavapipe
(a segfault in the shader: `x.var(1)` of 64x2048, the group norm of
MaskFormer's pixel decoder). There var, var_mean and group norm are two-pass
float32 moments: the mean, then the mean of squared deviations, each sum in
blocks (long_sums) as the CPU kernels' cascade sums.
"""

from __future__ import annotations

import math

import torch

from ..target import gpu_target

aten = torch.ops.aten


def _dims(x, dim) -> list:
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return list(range(x.dim()))
    dims = [dim] if isinstance(dim, int) else list(dim)
    return sorted({d % x.dim() for d in dims}) if x.dim() else []


def _var_mean(x, dim, correction, keepdim):
    dims = _dims(x, dim)
    count = math.prod(x.shape[d] for d in dims)
    mean = aten.mean.dim(x, dims, True)
    deviation = aten.sub.Tensor(x, mean)
    squares = aten.sum.dim_IntList(aten.mul.Tensor(deviation, deviation), dims, keepdim)
    # PyTorch divides by max(0, N - correction): 0/0 is nan, x/0 inf
    var = aten.div.Scalar(squares, max(count - (1 if correction is None else correction), 0))
    if not keepdim:
        mean = aten.reshape.default(mean, [n for d, n in enumerate(x.shape) if d not in dims])
    return var, mean


def _applies(x) -> bool:
    return gpu_target() and isinstance(x, torch.Tensor) and x.dtype == torch.float32 and x.numel() > 0


def var(x, dim=None, *, correction=None, keepdim=False):
    if not _applies(x):
        return NotImplemented
    return _var_mean(x, dim, correction, keepdim)[0]


def var_mean(x, dim=None, *, correction=None, keepdim=False):
    if not _applies(x):
        return NotImplemented
    return _var_mean(x, dim, correction, keepdim)


def native_group_norm(x, weight, bias, n, channels, hxw, group, eps):
    if not _applies(x):
        return NotImplemented
    grouped = aten.reshape.default(x, [n, group, -1])
    var_, mean = _var_mean(grouped, [2], 0, True)
    rstd = aten.rsqrt.default(aten.add.Scalar(var_, eps))
    out = aten.reshape.default(aten.mul.Tensor(aten.sub.Tensor(grouped, mean), rstd), list(x.shape))
    shape = [1, channels] + [1] * (x.dim() - 2)
    if weight is not None:
        out = aten.mul.Tensor(out, aten.reshape.default(weight, shape))
    if bias is not None:
        out = aten.add.Tensor(out, aten.reshape.default(bias, shape))
    return out, aten.reshape.default(mean, [n, group]), aten.reshape.default(rstd, [n, group])


def decompositions() -> dict:
    return {aten.var.correction: var, aten.var_mean.correction: var_mean,
            aten.native_group_norm.default: native_group_norm}
