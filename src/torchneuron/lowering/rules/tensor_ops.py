"""Decompositions of ops torch-mlir does not lower (or lowers wrongly), into
ops it does: shapes are static here, so index lists are built at trace time
and become constants of the executable."""

from __future__ import annotations

import math

import torch

aten = torch.ops.aten


def roll(x, shifts, dims=()):
    shifts = [shifts] if isinstance(shifts, int) else list(shifts)
    dims = [dims] if isinstance(dims, int) else list(dims)
    if not dims:  # roll the flattened tensor
        return roll(x.reshape(-1), shifts, [0]).reshape(x.shape)
    out = x
    for shift, dim in zip(shifts, dims):
        size = out.shape[dim]
        s = shift % size if size else 0
        if s:
            out = torch.cat([out.narrow(dim, size - s, s), out.narrow(dim, 0, size - s)], dim)
    return out.clone() if out is x else out


def _nan_aware(pick):
    def decompose(a, b):
        m = pick(a, b)
        a, b = a.to(m.dtype), b.to(m.dtype)
        if not m.dtype.is_floating_point:
            return m
        return torch.where(torch.isnan(a), b, torch.where(torch.isnan(b), a, m))

    return decompose


def hypot(a, b):
    a, b = torch.broadcast_tensors(a, b)
    dtype = torch.result_type(a, b)
    a, b = torch.abs(a.to(dtype)), torch.abs(b.to(dtype))
    big, small = torch.maximum(a, b), torch.minimum(a, b)
    ratio = small / torch.where(big == 0, torch.ones_like(big), big)
    out = big * torch.sqrt(1 + ratio * ratio)  # no overflow of a*a
    out = torch.where(torch.isnan(a) | torch.isnan(b), torch.full_like(out, math.nan), out)
    return torch.where(torch.isinf(a) | torch.isinf(b), torch.full_like(out, math.inf), out)


def angle(x):
    if x.dtype.is_complex:
        return torch.atan2(x.imag, x.real)
    dtype = x.dtype if x.dtype.is_floating_point else torch.get_default_dtype()
    x = x.to(dtype)
    out = torch.where(x < 0, torch.full_like(x, math.pi), torch.zeros_like(x))
    return torch.where(torch.isnan(x), x, out)


def cdist(x1, x2, p, compute_mode=None):
    diff = torch.abs(x1.unsqueeze(-2) - x2.unsqueeze(-3))
    if p == 0:
        return (diff != 0).to(x1.dtype).sum(-1)
    if math.isinf(p):
        return diff.amax(-1) if diff.shape[-1] else diff.sum(-1)
    if p == 1:
        return diff.sum(-1)
    if p == 2:
        return torch.sqrt((diff * diff).sum(-1))
    return torch.pow(torch.pow(diff, p).sum(-1), 1.0 / p)


def _nearest_indices(in_size, out_size, scale, exact):
    # PyTorch's rule: the scale factor the user gave, else in/out.
    ratio = 1.0 / scale if scale else in_size / out_size
    offset = 0.5 if exact else 0.0
    return [min(math.floor((i + offset) * ratio), in_size - 1) for i in range(out_size)]


def _upsample_nearest(exact):
    def decompose(x, output_size, *scales):
        spatial = len(output_size)
        scales = list(scales) + [None] * (spatial - len(scales))
        for k, (out, scale) in enumerate(zip(output_size, scales)):
            dim = x.dim() - spatial + k
            idx = _nearest_indices(x.shape[dim], out, scale, exact)
            x = torch.index_select(x, dim, torch.tensor(idx, device=x.device))
        return x

    return decompose


def isin(elements, test_elements, *, assume_unique=False, invert=False):
    flat = test_elements.reshape(-1)
    if flat.numel() == 0:
        found = torch.zeros(elements.shape, dtype=torch.bool, device=elements.device)
    else:
        found = (elements.unsqueeze(-1) == flat).any(-1)
    return ~found if invert else found


MAX_SCAN = 1024


def logcumsumexp(x, dim):
    """A masked logsumexp over each prefix (n x n): exact where a running
    max-shift would underflow the small terms to -inf."""
    if x.dtype.is_complex:
        raise NotImplementedError("complex logcumsumexp")
    if x.dim() == 0:
        return x.clone()
    n = x.shape[dim]
    if n > MAX_SCAN:
        raise NotImplementedError(f"logcumsumexp over more than {MAX_SCAN} elements")
    moved = x.movedim(dim, -1)
    pos = torch.arange(n, device=x.device)
    prefix = pos.unsqueeze(0) <= pos.unsqueeze(1)  # [i, j]: j <= i
    values = moved.unsqueeze(-2).expand(*moved.shape[:-1], n, n)
    masked = torch.where(prefix, values, torch.full_like(values, -math.inf))
    return torch.logsumexp(masked, -1).movedim(-1, dim).contiguous()


def eye(n, m=None, *, dtype=None, layout=None, device=None, pin_memory=None):
    # PyTorch's own decomposition builds a uint8 arange, which crashes the compiler.
    m = n if m is None else m
    hit = torch.arange(n, device=device).unsqueeze(-1) == torch.arange(m, device=device)
    return hit.to(dtype or torch.get_default_dtype())


def put(x, index, source, accumulate=False):
    flat = x.reshape(-1)
    index = index.reshape(-1)
    index = torch.where(index < 0, index + flat.numel(), index)
    return torch.index_put(flat, (index,), source.reshape(-1), accumulate).reshape(x.shape)


def _is_mask(index) -> bool:
    return index is not None and index.dtype in (torch.bool, torch.uint8)


def index_put_by_mask(x, indices, values, accumulate=False):
    """x[mask] = values as a select: the compiled index_put of a boolean mask
    wrote its value into element 0 when the mask was all False (an empty
    nonzero padded with index 0). A mask over x's leading dims takes each
    true element's value from `values` in order (cumsum of the mask), or
    broadcast; other uses of a mask run on the host. Without a mask:
    NotImplemented (the op itself)."""
    if not any(_is_mask(i) for i in indices):
        return NotImplemented
    mask = indices[0]
    if len(indices) != 1 or not _is_mask(mask) or tuple(x.shape[: mask.dim()]) != tuple(mask.shape):
        raise NotImplementedError("a boolean index beside other indices")
    mask = mask.bool()
    rest = tuple(x.shape[mask.dim():])
    values = values.to(x.dtype)
    if values.dim() == len(rest) + 1 and values.shape[0] == 0:
        return x.clone()  # no value rows: no element is true
    if values.dim() == len(rest) + 1:
        # one value row per true element, in order: row k for the k-th true element
        rows = values.expand((values.shape[0], *rest))
        position = (mask.reshape(-1).to(torch.int64).cumsum(0) - 1).clamp(0, values.shape[0] - 1)
        chosen = rows.index_select(0, position).reshape(x.shape)
    else:
        chosen = values.expand(x.shape) if values.dim() <= len(rest) else values.reshape(rest).expand(x.shape)
    selected = mask.reshape(mask.shape + (1,) * len(rest))
    if accumulate:
        return x + torch.where(selected, chosen, torch.zeros_like(chosen))
    return torch.where(selected, chosen, x)


def _index_put_by_mask(x, indices, values, accumulate=False):
    result = index_put_by_mask(x, indices, values, accumulate)
    if result is NotImplemented:
        return aten.index_put.default(x, indices, values, accumulate)
    return result


def _index_put_by_mask_(x, indices, values, accumulate=False, unsafe=False):
    if not any(_is_mask(i) for i in indices):
        if unsafe:
            return aten._index_put_impl_.default(x, indices, values, accumulate, unsafe)
        return aten.index_put_.default(x, indices, values, accumulate)
    return x.copy_(index_put_by_mask(x, indices, values, accumulate))


def scatter_with_reduce(x, dim, index, src, *, reduce):
    names = {"add": "sum", "multiply": "prod"}
    return torch.scatter_reduce(x, dim, index, src, names[reduce], include_self=True)


def index_reduce(x, dim, index, source, reduce, *, include_self=True):
    dim = dim % max(x.dim(), 1)
    shape = [1] * source.dim()
    if source.dim():
        shape[dim] = -1
    expanded = index.reshape(shape).expand(source.shape)
    return torch.scatter_reduce(x, dim, expanded, source, reduce, include_self=include_self)


def _in_place(functional):
    def decompose(x, *args, **kwargs):
        return x.copy_(functional(x, *args, **kwargs))

    return decompose


# Rewrites of a call that end in the same op (so they must not enter the
# export's decomposition table, where they would call themselves).


def adaptive_max_pool2d(x, output_size):
    """torch-mlir takes batched input with divisible sizes only; otherwise
    one window per output cell (PyTorch's floor/ceil window bounds)."""
    op = aten.adaptive_max_pool2d.default
    (H, W), (oh, ow) = x.shape[-2:], output_size
    if H % oh == 0 and W % ow == 0:
        if x.dim() == 3:
            return tuple(r.squeeze(0) for r in op(x.unsqueeze(0), output_size))
        return op(x, output_size)
    values, indices = [], []
    for i in range(oh):
        h0, h1 = (i * H) // oh, -((-(i + 1) * H) // oh)
        for j in range(ow):
            w0, w1 = (j * W) // ow, -((-(j + 1) * W) // ow)
            v, a = x[..., h0:h1, w0:w1].flatten(-2).max(-1)
            kw = w1 - w0
            values.append(v)
            indices.append((h0 + a // kw) * W + (w0 + a % kw))
    shape = (*x.shape[:-2], oh, ow)
    return torch.stack(values, -1).reshape(shape), torch.stack(indices, -1).reshape(shape)


def weight_norm_backward(grad_w, v, g, norms, dim):
    """_weight_norm_interface's backward (w = g * v / |v|, the norm over every
    dimension but `dim`), which has CPU and CUDA kernels only: weight-normed
    convolutions (encodec's) ran their backward on the host."""
    dims = [d for d in range(v.dim()) if d != dim % v.dim()]
    grad_g = aten.div.Tensor(aten.sum.dim_IntList(aten.mul.Tensor(grad_w, v), dims, True), norms)
    grad_v = aten.mul.Tensor(aten.div.Tensor(g, norms),
                             aten.sub.Tensor(grad_w, aten.mul.Tensor(v, aten.div.Tensor(grad_g, norms))))
    return grad_v, aten.reshape.default(grad_g, g.shape)


def cumprod(x, dim, dtype=None):
    return aten.cumprod.default(x.to(dtype) if dtype is not None else x, dim)


def _empty_inner(op):
    def decompose(a, b, *args, **kwargs):
        if a.shape[-1] == 0:  # the compiler crashes on a zero reduction length
            shape = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
            return torch.zeros(shape, dtype=a.dtype, device=a.device)
        return op(a, b, *args, **kwargs)

    return decompose


def _exact_extent(x, weight, stride, padding, dilation, transposed):
    """For a strided convolution whose last window stops short of the padded
    input's end (a 2x2 input, 3x3 kernel, padding 1, stride 2), which fails
    to compile (torch-mlir infers the padded size one way and linalg
    another): (padded sizes, the extent the windows cover, per-dim params),
    or None when the convolution is not such a one."""
    n = x.dim() - 2
    if transposed or n < 1:
        return None

    def per_dim(values):
        values = list(values)
        return values * n if len(values) == 1 else values

    stride, padding, dilation = per_dim(stride), per_dim(padding), per_dim(dilation)
    sizes = [x.shape[2 + i] + 2 * padding[i] for i in range(n)]
    reach = [dilation[i] * (weight.shape[2 + i] - 1) + 1 for i in range(n)]
    covered = [(sizes[i] - reach[i]) // stride[i] * stride[i] + reach[i] for i in range(n)]
    if covered == sizes or any(c <= 0 for c in covered):
        return None
    return sizes, covered, stride, padding, dilation


def _padded_and_cut(x, padding, covered):
    """x padded explicitly and cut to the extent the windows cover."""
    pads = []
    for p in reversed(padding):
        pads += [p, p]
    x = torch.nn.functional.pad(x, pads)
    for i, c in enumerate(covered):
        x = x.narrow(2 + i, 0, c)
    return x


def convolution_exact_extent(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    exact = _exact_extent(x, weight, stride, padding, dilation, transposed)
    if exact is None:
        return aten.convolution.default(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
    _, covered, stride, padding, dilation = exact
    return aten.convolution.default(_padded_and_cut(x, padding, covered), weight, bias, stride, [0] * len(covered),
                                    dilation, transposed, output_padding, groups)


def _convolution_backward_exact_extent(grad, x, weight, bias_sizes, stride, padding, dilation, transposed,
                                       output_padding, groups, output_mask):
    op = aten.convolution_backward.default
    exact = _exact_extent(x, weight, stride, padding, dilation, transposed)
    if exact is None:
        return op(grad, x, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups,
                  output_mask)
    sizes, covered, stride, padding, dilation = exact
    n = len(covered)
    grad_input, grad_weight, grad_bias = op(grad, _padded_and_cut(x, padding, covered), weight, bias_sizes, stride,
                                            [0] * n, dilation, transposed, output_padding, groups, output_mask)
    if grad_input is not None:
        # back to the padded size (the uncovered end got no gradient), then the input's part of it
        pads = []
        for i in reversed(range(n)):
            pads += [0, sizes[i] - covered[i]]
        grad_input = torch.nn.functional.pad(grad_input, pads)
        for i in range(n):
            grad_input = grad_input.narrow(2 + i, padding[i], x.shape[2 + i])
    return grad_input, grad_weight, grad_bias


def direct_rewrites() -> dict:
    return {
        aten.convolution.default: convolution_exact_extent,
        aten.index_put.default: _index_put_by_mask,
        aten.index_put_.default: _index_put_by_mask_,
        aten._index_put_impl_.default: _index_put_by_mask_,
        aten.convolution_backward.default: _convolution_backward_exact_extent,
        aten.adaptive_max_pool2d.default: adaptive_max_pool2d,
        aten.cumprod.default: cumprod,
        aten.mm.default: _empty_inner(aten.mm.default),
        aten.bmm.default: _empty_inner(aten.bmm.default),
    }


def _whole_extreme(reduce):
    """max() / min() of a whole tensor as amax / amin over every dimension,
    uint8 and bool in int32: torch-mlir has no initial element for those
    (the compiler crashed). (A rule that gives the op back, NotImplemented,
    breaks this op's export.)"""
    def decompose(x):
        if x.dtype in (torch.uint8, torch.bool):
            return reduce(x.to(torch.int32), list(range(x.dim()))).to(x.dtype)
        return reduce(x, list(range(x.dim())))

    return decompose


def decompositions() -> dict:
    table = {
        aten.max.default: _whole_extreme(torch.amax),
        aten.min.default: _whole_extreme(torch.amin),
        aten._weight_norm_interface_backward.default: weight_norm_backward,
        aten.roll.default: roll,
        aten.fmax.default: _nan_aware(torch.maximum),
        aten.fmin.default: _nan_aware(torch.minimum),
        aten.hypot.default: hypot,
        aten.angle.default: angle,
        aten._cdist_forward.default: cdist,
        aten.upsample_nearest1d.default: _upsample_nearest(False),
        aten.upsample_nearest2d.default: _upsample_nearest(False),
        aten.upsample_nearest3d.default: _upsample_nearest(False),
        aten._upsample_nearest_exact1d.default: _upsample_nearest(True),
        aten._upsample_nearest_exact2d.default: _upsample_nearest(True),
        aten._upsample_nearest_exact3d.default: _upsample_nearest(True),
        aten.isin.Tensor_Tensor: isin,
        aten.eye.default: eye,
        aten.eye.m: eye,
        aten.logcumsumexp.default: logcumsumexp,
        aten.put.default: put,
        aten.put_.default: _in_place(put),
        aten.scatter.reduce: scatter_with_reduce,
        aten.scatter_.reduce: _in_place(scatter_with_reduce),
        aten.index_reduce.default: index_reduce,
        aten.index_reduce_.default: _in_place(index_reduce),
    }
    return table
