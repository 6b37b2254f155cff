"""Complex values as pairs of reals inside a lowered graph.

IREE 3.13 holds complex<f32>/complex<f64> buffers and compiles complex
multiplies and matmuls, but not abs, exp, sums or any FFT (torch-mlir has no
complex math lowering). So an exported graph keeps its complex inputs and
outputs (the executable reads and writes the tensors' own memory) and every
op inside that touches a complex value is rewritten over its real pair view,
`view_as_real(z)`: shape + (2,), real part then imaginary part, the layout
complex numbers have in memory. FFTs become products with DFT matrices
computed in the graph.

A complex op with no rule here leaves the graph NotCompilable: the call takes
the host path, which is recorded, as for any op the compiler cannot take.
"""

from __future__ import annotations

import math
import operator

import torch
from torch._guards import detect_fake_mode

from .call import NotCompilable

aten = torch.ops.aten
prims = torch.ops.prims


def _val(n):
    return n.meta.get("val") if isinstance(n, torch.fx.Node) else None


def _is_complex(n) -> bool:
    if isinstance(n, complex):
        return True
    v = _val(n)
    if isinstance(v, (list, tuple)):
        return any(isinstance(x, torch.Tensor) and x.is_complex() for x in v)
    return isinstance(v, torch.Tensor) and v.is_complex()


def _involves_complex(node) -> bool:
    if _is_complex(node):
        return True
    for a in node.args + tuple(node.kwargs.values()):
        if isinstance(a, (list, tuple)):
            if any(_is_complex(x) for x in a):
                return True
        elif _is_complex(a):
            return True
    dtype = node.kwargs.get("dtype")
    return isinstance(dtype, torch.dtype) and dtype.is_complex


def _real_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype.to_real() if dtype.is_complex else dtype


def graph_has_complex(gm: torch.fx.GraphModule) -> bool:
    return any(_involves_complex(n) for n in gm.graph.nodes if n.op in ("placeholder", "call_function"))


class _Builder:
    """Emits nodes before the node being rewritten, with their fake values."""

    def __init__(self, graph, fake_mode, pairs):
        self.graph = graph
        self.fake_mode = fake_mode
        self.pairs = pairs  # complex node -> its real pair node

    def op(self, target, *args, **kwargs):
        node = self.graph.call_function(target, args, kwargs)
        fake_args, fake_kwargs = torch.fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
        with self.fake_mode:
            node.meta["val"] = target(*fake_args, **fake_kwargs)
        return node

    # -- pieces
    def re(self, p):
        return self.op(aten.select.int, p, -1, 0)

    def im(self, p):
        return self.op(aten.select.int, p, -1, 1)

    def pair_of(self, re, im):
        return self.op(aten.stack.default, [re, im], -1)

    def number(self, value, dtype):
        return self.op(aten.scalar_tensor.default, value, dtype=dtype)

    def pair(self, v, dtype):
        """The real pair of an operand: complex nodes, real tensors (imaginary
        part 0) and numbers, in the real dtype `dtype`."""
        if isinstance(v, torch.fx.Node) and v in self.pairs:
            p = self.pairs[v]
            return p if p.meta["val"].dtype == dtype else self.op(prims.convert_element_type.default, p, dtype)
        if isinstance(v, torch.fx.Node) and not isinstance(v.meta["val"], torch.Tensor):
            v = self.number(v, dtype)  # a traced runtime number (an executable's scalar input)
        if isinstance(v, torch.fx.Node):
            x = v if v.meta["val"].dtype == dtype else self.op(prims.convert_element_type.default, v, dtype)
            return self.pair_of(x, self.op(aten.zeros_like.default, x))
        c = complex(v)
        return self.pair_of(self.number(c.real, dtype), self.number(c.imag, dtype))

    def real_operand(self, v, dtype):
        """A real tensor operand broadcast against pairs (a trailing 1)."""
        if isinstance(v, torch.fx.Node) and not isinstance(v.meta["val"], torch.Tensor):
            return self.number(v, dtype)  # a traced runtime number
        if isinstance(v, torch.fx.Node):
            if v.meta["val"].dtype != dtype:
                v = self.op(prims.convert_element_type.default, v, dtype)
            return self.op(aten.unsqueeze.default, v, -1)
        return v

    def product(self, a, b):
        ar, ai, br, bi = self.re(a), self.im(a), self.re(b), self.im(b)
        re = self.op(aten.sub.Tensor, self.op(aten.mul.Tensor, ar, br), self.op(aten.mul.Tensor, ai, bi))
        im = self.op(aten.add.Tensor, self.op(aten.mul.Tensor, ar, bi), self.op(aten.mul.Tensor, ai, br))
        return self.pair_of(re, im)

    def abs_squared(self, p):
        return self.op(aten.sum.dim_IntList, self.op(aten.mul.Tensor, p, p), [-1])

    def magnitude(self, p):
        """|z| without overflow or underflow in the squares (as C's hypot):
        big * sqrt(1 + (small/big)^2); infinite if either part is, else NaN
        if either part is."""
        a, c = self.op(aten.abs.default, self.re(p)), self.op(aten.abs.default, self.im(p))
        big, small = self.op(aten.maximum.default, a, c), self.op(aten.minimum.default, a, c)
        ratio = self.op(aten.div.Tensor, small, big)
        r = self.op(aten.mul.Tensor, big, self.op(aten.sqrt.default,
                                                  self.op(aten.add.Tensor, self.op(aten.mul.Tensor, ratio, ratio), 1)))
        r = self.op(aten.where.self, self.op(aten.eq.Scalar, big, 0), self.op(aten.zeros_like.default, r), r)
        # NaN unless a part is infinite (IREE's maximum does not propagate NaN)
        unknown = self.op(aten.logical_or.default, self.op(aten.isnan.default, a), self.op(aten.isnan.default, c))
        r = self.op(aten.where.self, unknown, self.op(aten.full_like.default, r, math.nan), r)
        infinite = self.op(aten.logical_or.default, self.op(aten.isinf.default, a), self.op(aten.isinf.default, c))
        return self.op(aten.where.self, infinite, self.op(aten.full_like.default, r, math.inf), r)

    def quotient(self, x, y):
        """x / y, with y scaled by its larger part first so that its squared
        magnitude neither overflows nor underflows (as CPU's kernels do)."""
        scale = self.op(aten.amax.default, self.op(aten.abs.default, y), [-1], True)
        ys = self.op(aten.div.Tensor, y, scale)
        denominator = self.op(aten.mul.Tensor, self.op(aten.unsqueeze.default, self.abs_squared(ys), -1), scale)
        return self.op(aten.div.Tensor, self.product(x, self.conj(ys)), denominator)

    def conj(self, p):
        return self.op(aten.mul.Tensor, p, self.sign_vector(p.meta["val"].dtype))

    def sign_vector(self, dtype):
        return self.pair_of(self.number(1.0, dtype), self.number(-1.0, dtype))

    def polar(self, r, theta):
        return self.pair_of(
            self.op(aten.mul.Tensor, r, self.op(aten.cos.default, theta)),
            self.op(aten.mul.Tensor, r, self.op(aten.sin.default, theta)),
        )

    def magnitude_angle(self, p):
        r = self.magnitude(p)
        theta = self.op(aten.atan2.default, self.im(p), self.re(p))
        return r, theta


def _rank(node) -> int:
    return node.meta["val"].dim()


def _dim(d: int, rank: int) -> int:
    """A logical dim of a complex tensor, non-negative (the pair's trailing
    dim stays last, so negative dims would shift). A 0-dim tensor's dim 0 or
    -1 names no dim of the pair."""
    if rank == 0:
        raise NotCompilable("a dim argument of a 0-dim complex tensor")
    return d + rank if d < 0 else d


# ---- rules: (builder, node) -> the result's pair (complex results) or value (real results)

_RULES: dict = {}


def _rule(*targets):
    def register(fn):
        for t in targets:
            _RULES[t] = fn
        return fn

    return register


def _out_dtype(node):
    val = node.meta["val"]
    return _real_dtype(val.dtype)


@_rule(aten.add.Tensor, aten.sub.Tensor, aten.add.Scalar, aten.sub.Scalar)
def _add(b, node):
    dt = _out_dtype(node)
    x, y = node.args[0], node.args[1]
    alpha = node.kwargs.get("alpha", node.args[2] if len(node.args) > 2 else 1)
    if isinstance(alpha, complex):
        if alpha.imag:
            raise NotCompilable("a complex alpha")
        alpha = alpha.real
    py = b.pair(y, dt)
    if alpha != 1:
        py = b.op(aten.mul.Tensor, py, alpha)
    op = aten.sub.Tensor if node.target in (aten.sub.Tensor, aten.sub.Scalar) else aten.add.Tensor
    return b.op(op, b.pair(x, dt), py)


@_rule(aten.mul.Tensor, aten.mul.Scalar)
def _mul(b, node):
    dt = _out_dtype(node)
    x, y = node.args
    if not _is_complex(y):
        return b.op(aten.mul.Tensor, b.pair(x, dt), b.real_operand(y, dt))
    if not _is_complex(x):
        return b.op(aten.mul.Tensor, b.pair(y, dt), b.real_operand(x, dt))
    return b.product(b.pair(x, dt), b.pair(y, dt))


@_rule(aten.div.Tensor, aten.div.Scalar)
def _div(b, node):
    dt = _out_dtype(node)
    x, y = node.args
    if not _is_complex(y):
        return b.op(aten.div.Tensor, b.pair(x, dt), b.real_operand(y, dt))
    return b.quotient(b.pair(x, dt), b.pair(y, dt))


@_rule(aten.reciprocal.default)
def _reciprocal(b, node):
    dt = _out_dtype(node)
    return b.quotient(b.pair(1.0, dt), b.pair(node.args[0], dt))


@_rule(aten.neg.default, aten._neg_view.default)
def _neg(b, node):
    return b.op(aten.neg.default, b.pair(node.args[0], _out_dtype(node)))


@_rule(aten.conj_physical.default, aten._conj.default, aten.conj.default, aten._conj_physical.default)
def _conj(b, node):
    return b.conj(b.pair(node.args[0], _out_dtype(node)))


@_rule(aten.clone.default, aten.alias.default, aten.resolve_conj.default, aten.resolve_neg.default,
       aten.lift_fresh_copy.default, aten.contiguous.default)
def _same(b, node):
    return b.pair(node.args[0], _out_dtype(node))


@_rule(aten.abs.default)
def _abs(b, node):
    return b.magnitude(b.pair(node.args[0], _out_dtype(node)))


@_rule(aten.angle.default)
def _angle(b, node):
    p = b.pair(node.args[0], _out_dtype(node))
    return b.op(aten.atan2.default, b.im(p), b.re(p))


@_rule(aten.sgn.default)
def _sgn(b, node):
    p = b.pair(node.args[0], _out_dtype(node))
    r = b.op(aten.unsqueeze.default, b.magnitude(p), -1)
    unit = b.op(aten.div.Tensor, p, r)
    return b.op(aten.where.self, b.op(aten.eq.Scalar, r, 0), b.op(aten.zeros_like.default, p), unit)


@_rule(aten.exp.default)
def _exp(b, node):
    p = b.pair(node.args[0], _out_dtype(node))
    return b.polar(b.op(aten.exp.default, b.re(p)), b.im(p))


@_rule(aten.log.default)
def _log(b, node):
    r, theta = b.magnitude_angle(b.pair(node.args[0], _out_dtype(node)))
    return b.pair_of(b.op(aten.log.default, r), theta)


@_rule(aten.sqrt.default)
def _sqrt(b, node):
    r, theta = b.magnitude_angle(b.pair(node.args[0], _out_dtype(node)))
    return b.polar(b.op(aten.sqrt.default, r), b.op(aten.mul.Tensor, theta, 0.5))


@_rule(aten.pow.Tensor_Scalar)
def _pow(b, node):
    exponent = node.args[1]
    if isinstance(exponent, complex):
        raise NotCompilable("a complex exponent")
    r, theta = b.magnitude_angle(b.pair(node.args[0], _out_dtype(node)))
    return b.polar(b.op(aten.pow.Tensor_Scalar, r, exponent), b.op(aten.mul.Tensor, theta, exponent))


@_rule(aten.sin.default, aten.cos.default, aten.sinh.default, aten.cosh.default)
def _trig(b, node):
    p = b.pair(node.args[0], _out_dtype(node))
    x, y = b.re(p), b.im(p)

    def mul(f, u, g, v):
        return b.op(aten.mul.Tensor, b.op(f, u), b.op(g, v))

    sin, cos, sinh, cosh = aten.sin.default, aten.cos.default, aten.sinh.default, aten.cosh.default
    if node.target is sin:  # sin x cosh y + i cos x sinh y
        return b.pair_of(mul(sin, x, cosh, y), mul(cos, x, sinh, y))
    if node.target is cos:  # cos x cosh y - i sin x sinh y
        return b.pair_of(mul(cos, x, cosh, y), b.op(aten.neg.default, mul(sin, x, sinh, y)))
    if node.target is sinh:  # sinh x cos y + i cosh x sin y
        return b.pair_of(mul(sinh, x, cos, y), mul(cosh, x, sin, y))
    return b.pair_of(mul(cosh, x, cos, y), mul(sinh, x, sin, y))  # cosh x cos y + i sinh x sin y


@_rule(aten.eq.Tensor, aten.ne.Tensor, aten.eq.Scalar, aten.ne.Scalar)
def _equal(b, node):
    x, y = node.args
    dt = _real_dtype(torch.promote_types(
        _val(x).dtype if _val(x) is not None else torch.complex64,
        _val(y).dtype if _val(y) is not None else torch.complex64))
    same = b.op(aten.eq.Tensor, b.pair(x, dt), b.pair(y, dt))
    both = b.op(aten.logical_and.default, b.re(same), b.im(same))
    return both if node.target in (aten.eq.Tensor, aten.eq.Scalar) else b.op(aten.logical_not.default, both)


@_rule(aten.real.default)
def _real(b, node):
    return b.re(b.pair(node.args[0], _real_dtype(_val(node.args[0]).dtype)))


@_rule(aten.imag.default)
def _imag(b, node):
    return b.im(b.pair(node.args[0], _real_dtype(_val(node.args[0]).dtype)))


@_rule(aten.view_as_real.default)
def _view_as_real(b, node):
    return b.pair(node.args[0], _out_dtype(node))


@_rule(aten.view_as_complex.default)
def _view_as_complex(b, node):
    return node.args[0]


@_rule(aten.complex.default)
def _complex(b, node):
    dt = _out_dtype(node)
    re, im = (b.op(prims.convert_element_type.default, v, dt) if _val(v).dtype != dt else v for v in node.args)
    return b.op(aten.stack.default, [b.op(aten.expand.default, re, list(node.meta["val"].shape)),
                                     b.op(aten.expand.default, im, list(node.meta["val"].shape))], -1)


@_rule(aten.polar.default)
def _polar(b, node):
    return b.polar(*node.args)


@_rule(prims.convert_element_type.default, aten._to_copy.default)
def _convert(b, node):
    x = node.args[0]
    out = node.meta["val"].dtype
    if out.is_complex:
        return b.pair(x, _real_dtype(out))
    p = b.pair(x, _real_dtype(_val(x).dtype))
    if out == torch.bool:
        return b.op(aten.any.dim, b.op(aten.ne.Scalar, p, 0), -1)
    return b.op(prims.convert_element_type.default, b.re(p), out)


@_rule(aten.copy.default)
def _copy(b, node):
    dest, src = node.args[0], node.args[1]
    out = node.meta["val"]
    if not out.is_complex:
        return b.op(prims.convert_element_type.default, b.re(b.pair(src, _real_dtype(_val(src).dtype))), out.dtype)
    return b.op(aten.expand.default, b.pair(src, _real_dtype(out.dtype)), list(out.shape) + [2])


_FILL_VALUES = {
    aten.zeros.default: lambda n: 0, aten.ones.default: lambda n: 1, aten.empty.memory_format: lambda n: 0,
    aten.full.default: lambda n: n.args[1], aten.scalar_tensor.default: lambda n: n.args[0],
    aten.zeros_like.default: lambda n: 0, aten.ones_like.default: lambda n: 1, aten.empty_like.default: lambda n: 0,
    aten.full_like.default: lambda n: n.args[1],
}


@_rule(*_FILL_VALUES)
def _factory(b, node):
    out = node.meta["val"]
    dt = _real_dtype(out.dtype)
    c = complex(_FILL_VALUES[node.target](node))
    shape = list(out.shape)
    return b.pair_of(b.op(aten.full.default, shape, c.real, dtype=dt), b.op(aten.full.default, shape, c.imag, dtype=dt))


@_rule(aten.where.self)
def _where(b, node):
    cond, x, y = node.args
    dt = _out_dtype(node)
    return b.op(aten.where.self, b.op(aten.unsqueeze.default, cond, -1), b.pair(x, dt), b.pair(y, dt))


# -- shapes: the pair's trailing dim rides along

def _shape_rule(target, rebuild):
    def rule(b, node):
        x = node.args[0]
        p = b.pair(x, _real_dtype(_val(x).dtype))
        args, kwargs = rebuild(node, _rank(x))
        return b.op(target, p, *args, **kwargs)

    return rule


def _sizes(s):
    return list(s) + [2]


_RULES[aten.view.default] = _shape_rule(aten.view.default, lambda n, r: ([_sizes(n.meta["val"].shape)], {}))
_RULES[aten._unsafe_view.default] = _RULES[aten.view.default]
_RULES[aten.reshape.default] = _shape_rule(aten.reshape.default, lambda n, r: ([_sizes(n.meta["val"].shape)], {}))
_RULES[aten.expand.default] = _shape_rule(aten.expand.default, lambda n, r: ([_sizes(n.meta["val"].shape)], {}))
_RULES[aten.permute.default] = _shape_rule(
    aten.permute.default, lambda n, r: ([[_dim(d, r) for d in n.args[1]] + [r]], {}))
_RULES[aten.transpose.int] = _shape_rule(
    aten.transpose.int, lambda n, r: ([_dim(n.args[1], r), _dim(n.args[2], r)], {}))
_RULES[aten.t.default] = _shape_rule(aten.transpose.int, lambda n, r: ([0, r - 1] if r == 2 else [0, 0], {}))
_RULES[aten.unsqueeze.default] = _shape_rule(
    aten.unsqueeze.default, lambda n, r: ([_dim(n.args[1], r + 1)], {}))
_RULES[aten.squeeze.dim] = _shape_rule(aten.reshape.default, lambda n, r: ([_sizes(n.meta["val"].shape)], {}))
_RULES[aten.squeeze.dims] = _RULES[aten.squeeze.dim]
_RULES[aten.squeeze.default] = _RULES[aten.squeeze.dim]
_RULES[aten.select.int] = _shape_rule(aten.select.int, lambda n, r: ([_dim(n.args[1], r), n.args[2]], {}))
_RULES[aten.slice.Tensor] = _shape_rule(
    aten.slice.Tensor, lambda n, r: ([_dim(n.args[1] if len(n.args) > 1 else 0, r), *n.args[2:]], {}))
_RULES[aten.narrow.default] = _shape_rule(aten.narrow.default, lambda n, r: ([_dim(n.args[1], r), *n.args[2:]], {}))
_RULES[aten.flip.default] = _shape_rule(aten.flip.default, lambda n, r: ([[_dim(d, r) for d in n.args[1]]], {}))
_RULES[aten.repeat.default] = _shape_rule(aten.repeat.default, lambda n, r: ([list(n.args[1]) + [1]], {}))
_RULES[aten.index_select.default] = _shape_rule(
    aten.index_select.default, lambda n, r: ([_dim(n.args[1], r), n.args[2]], {}))
_RULES[aten.index.Tensor] = _shape_rule(aten.index.Tensor, lambda n, r: ([n.args[1]], {}))


@_rule(aten.as_strided.default)
def _as_strided(b, node):
    x, size, stride = node.args[:3]
    offset = node.args[3] if len(node.args) > 3 and node.args[3] is not None else 0
    # IREE's importer maps as_strided back onto the view chain's base, the
    # complex input, in its own units; a copy of the pair is a base in ours.
    base = b.op(aten.clone.default, b.pair(x, _real_dtype(_val(x).dtype)))
    return b.op(aten.as_strided.default, base, _sizes(size), [2 * s for s in stride] + [1], 2 * offset)


@_rule(aten.roll.default)
def _roll(b, node):
    x = node.args[0]
    p = b.pair(x, _real_dtype(_val(x).dtype))
    shifts = node.args[1]
    dims = node.args[2] if len(node.args) > 2 else []
    if not dims:  # roll of the flattened tensor
        flat = b.op(aten.reshape.default, p, [-1, 2])
        rolled = b.op(aten.roll.default, flat, shifts, [0])
        return b.op(aten.reshape.default, rolled, _sizes(node.meta["val"].shape))
    return b.op(aten.roll.default, p, shifts, [_dim(d, _rank(x)) for d in dims])


@_rule(aten.constant_pad_nd.default)
def _pad(b, node):
    x, pad = node.args[:2]
    value = complex(node.args[2] if len(node.args) > 2 else 0)
    p = b.pair(x, _out_dtype(node))
    return b.pair_of(b.op(aten.constant_pad_nd.default, b.re(p), pad, value.real),
                     b.op(aten.constant_pad_nd.default, b.im(p), pad, value.imag))


@_rule(aten.cat.default, aten.stack.default)
def _cat(b, node):
    dt = _out_dtype(node)
    tensors = node.args[0]
    dim = node.args[1] if len(node.args) > 1 else 0
    # (the output's rank: cat keeps its inputs' rank, stack's dim counts the new one)
    return b.op(node.target, [b.pair(t, dt) for t in tensors], _dim(dim, node.meta["val"].dim()))


@_rule(aten.split_with_sizes.default, aten.split.Tensor, aten.unbind.int)
def _split(b, node):
    x = node.args[0]
    p = b.pair(x, _real_dtype(_val(x).dtype))
    if node.target is aten.unbind.int:
        return b.op(aten.unbind.int, p, _dim(node.args[1] if len(node.args) > 1 else 0, _rank(x)))
    return b.op(node.target, p, node.args[1], _dim(node.args[2] if len(node.args) > 2 else 0, _rank(x)))


@_rule(operator.getitem)
def _getitem(b, node):
    return b.op(operator.getitem, b.pairs[node.args[0]], node.args[1])


@_rule(aten.index_put.default)
def _index_put(b, node):
    dest, indices, values = node.args[:3]
    accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    dt = _out_dtype(node)
    return b.op(aten.index_put.default, b.pair(dest, dt), indices, b.pair(values, dt), accumulate)


def _reduce_dims(node, x):
    rank = _rank(x)
    dims = node.args[1] if len(node.args) > 1 else None
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(rank))
    if isinstance(dims, int):
        dims = [dims]
    return [_dim(d, rank) for d in dims]


@_rule(aten.sum.dim_IntList, aten.mean.dim, aten.sum.default, aten.mean.default)
def _sum(b, node):
    x = node.args[0]
    dt = _out_dtype(node)
    p = b.pair(x, dt)
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    if _rank(x) == 0:
        return p  # any dim of a 0-dim tensor reduces nothing
    dims = _reduce_dims(node, x) if node.target in (aten.sum.dim_IntList, aten.mean.dim) else list(range(_rank(x)))
    if not dims:
        return p
    target = aten.mean.dim if node.target in (aten.mean.dim, aten.mean.default) else aten.sum.dim_IntList
    return b.op(target, p, dims, keepdim)


@_rule(aten.linalg_vector_norm.default)
def _vector_norm(b, node):
    x = node.args[0]
    rest = list(node.args[1:])
    # the norm of the magnitudes, a real tensor of the same logical shape
    return b.op(aten.linalg_vector_norm.default, b.magnitude(b.pair(x, _real_dtype(_val(x).dtype))), *rest,
                **{k: v for k, v in node.kwargs.items() if k != "dtype"})


@_rule(aten.var.correction, aten.std.correction)
def _variance(b, node):
    """E|z - mean z|^2 = var(re) + var(im), with the same correction."""
    x = node.args[0]
    p = b.pair(x, _out_dtype(node))
    args = list(node.args[1:])
    total = b.op(aten.add.Tensor, b.op(aten.var.correction, b.re(p), *args, **node.kwargs),
                 b.op(aten.var.correction, b.im(p), *args, **node.kwargs))
    return b.op(aten.sqrt.default, total) if node.target is aten.std.correction else total


@_rule(aten.rsqrt.default)
def _rsqrt(b, node):
    dt = _out_dtype(node)
    r, theta = b.magnitude_angle(b.pair(node.args[0], dt))
    return b.quotient(b.pair(1.0, dt), b.polar(b.op(aten.sqrt.default, r), b.op(aten.mul.Tensor, theta, 0.5)))


@_rule(aten.gather.default)
def _gather(b, node):
    x, dim, index = node.args[:3]
    p = b.pair(x, _out_dtype(node))
    both = b.op(aten.expand.default, b.op(aten.unsqueeze.default, index, -1), list(_val(index).shape) + [2])
    return b.op(aten.gather.default, p, _dim(dim, _rank(x)), both)


@_rule(aten.cumsum.default)
def _cumsum(b, node):
    x, dim = node.args[:2]
    return b.op(aten.cumsum.default, b.pair(x, _out_dtype(node)), _dim(dim, _rank(x)))


@_rule(aten.mm.default, aten.bmm.default)
def _matmul(b, node):
    x, y = node.args
    dt = _out_dtype(node)
    mm = node.target
    if not _is_complex(x):
        py = b.pair(y, dt)
        xr = b.op(prims.convert_element_type.default, x, dt) if _val(x).dtype != dt else x
        return b.pair_of(b.op(mm, xr, b.re(py)), b.op(mm, xr, b.im(py)))
    px = b.pair(x, dt)
    if not _is_complex(y):
        yr = b.op(prims.convert_element_type.default, y, dt) if _val(y).dtype != dt else y
        return b.pair_of(b.op(mm, b.re(px), yr), b.op(mm, b.im(px), yr))
    py = b.pair(y, dt)
    xr, xi, yr, yi = b.re(px), b.im(px), b.re(py), b.im(py)
    re = b.op(aten.sub.Tensor, b.op(mm, xr, yr), b.op(mm, xi, yi))
    im = b.op(aten.add.Tensor, b.op(mm, xr, yi), b.op(mm, xi, yr))
    return b.pair_of(re, im)


@_rule(aten.addmm.default)
def _addmm(b, node):
    bias, x, y = node.args[:3]
    beta = node.kwargs.get("beta", 1)
    alpha = node.kwargs.get("alpha", 1)
    if isinstance(beta, complex) or isinstance(alpha, complex):
        raise NotCompilable("complex beta or alpha")
    dt = _out_dtype(node)
    product = _matmul(b, _Stub(aten.mm.default, (x, y), node))
    if alpha != 1:
        product = b.op(aten.mul.Tensor, product, alpha)
    pb = b.pair(bias, dt)
    if beta != 1:
        pb = b.op(aten.mul.Tensor, pb, beta)
    return b.op(aten.add.Tensor, pb, product)


class _Stub:
    """A node-like (target, args) for reusing a rule."""

    def __init__(self, target, args, like):
        self.target = target
        self.args = args
        self.kwargs = {}
        self.meta = like.meta


# -- FFTs as products with DFT matrices


def _dft_matrices(b, n: int, dtype, rows: int | None = None, cols: int | None = None):
    """cos and sin of 2*pi*j*k/n for j < rows, k < cols (j*k reduced mod n in
    integers first, so large n keep their accuracy)."""
    rows = n if rows is None else rows
    cols = n if cols is None else cols
    j = b.op(aten.arange.default, rows, dtype=torch.int64)
    k = b.op(aten.arange.default, cols, dtype=torch.int64)
    jk = b.op(aten.remainder.Scalar, b.op(aten.mul.Tensor, b.op(aten.unsqueeze.default, j, 1),
                                          b.op(aten.unsqueeze.default, k, 0)), n)
    angle = b.op(aten.mul.Tensor, b.op(prims.convert_element_type.default, jk, dtype), 2.0 * math.pi / n)
    return b.op(aten.cos.default, angle), b.op(aten.sin.default, angle)


def _to_last(d: int, rank: int):
    """The permutation moving dim d last, and the one moving it back."""
    order = [i for i in range(rank) if i != d] + [d]
    back = [0] * rank
    for i, o in enumerate(order):
        back[o] = i
    return order, back


def _last(b, p, d: int, rank: int):
    """(re, im) of pair p with logical dim d moved last, and the permutation back."""
    order, back = _to_last(d, rank)
    moved = b.op(aten.permute.default, p, order + [rank])
    return b.re(moved), b.im(moved), back


def _restore(b, re, im, back, rank):
    return b.op(aten.permute.default, b.pair_of(re, im), back + [rank])


# Longest transform done as one DFT matrix product (two n x n matrices: 8 MiB
# in float32 at 1024); longer ones split into two shorter ones (four-step).
DIRECT_DFT = 1024


def _factor(n: int) -> int | None:
    """The divisor of n closest to sqrt(n) from below, or None for a prime."""
    for f in range(math.isqrt(n), 1, -1):
        if n % f == 0:
            return f
    return None


def _dft_last(b, xr, xi, forward: bool):
    """(re, im) of the DFT of (xr, xi) over their last dim."""
    n = xr.meta["val"].shape[-1]
    dt = xr.meta["val"].dtype
    mm = aten.matmul.default
    if n > DIRECT_DFT:
        n1 = _factor(n)
        if n1 is None:
            raise NotCompilable(f"an FFT over {n} points, a prime longer than {DIRECT_DFT}")
        return _four_step(b, xr, xi, n1, n // n1, forward)
    cos, sin = _dft_matrices(b, n, dt)
    rc, rs, ic, is_ = b.op(mm, xr, cos), b.op(mm, xr, sin), b.op(mm, xi, cos), b.op(mm, xi, sin)
    if forward:  # X_k = sum x_j e^{-2 pi i jk/n}
        return b.op(aten.add.Tensor, rc, is_), b.op(aten.sub.Tensor, ic, rs)
    return b.op(aten.sub.Tensor, rc, is_), b.op(aten.add.Tensor, ic, rs)


def _four_step(b, xr, xi, n1: int, n2: int, forward: bool):
    """A DFT of n = n1*n2 points as n2 DFTs of n1 points, twiddles, and n1 DFTs
    of n2 points (Cooley-Tukey): x[j1*n2 + j2] -> X[k1 + n1*k2]."""
    lead = list(xr.meta["val"].shape[:-1])
    n = n1 * n2
    dt = xr.meta["val"].dtype

    def split(v):  # [..., n] -> [..., n2 (j2), n1 (j1)]
        return b.op(aten.transpose.int, b.op(aten.reshape.default, v, lead + [n1, n2]), -1, -2)

    yr, yi = _dft_last(b, split(xr), split(xi), forward)  # [..., j2, k1]
    cos, sin = _dft_matrices(b, n, dt, rows=n2, cols=n1)  # angle 2 pi j2 k1 / n
    sign = -1.0 if forward else 1.0
    sin = b.op(aten.mul.Tensor, sin, sign)
    yr, yi = (b.op(aten.sub.Tensor, b.op(aten.mul.Tensor, yr, cos), b.op(aten.mul.Tensor, yi, sin)),
              b.op(aten.add.Tensor, b.op(aten.mul.Tensor, yr, sin), b.op(aten.mul.Tensor, yi, cos)))
    zr, zi = _dft_last(b, b.op(aten.transpose.int, yr, -1, -2), b.op(aten.transpose.int, yi, -1, -2), forward)

    def join(v):  # [..., k1, k2] -> [..., k2, k1] -> [..., n]
        return b.op(aten.reshape.default, b.op(aten.transpose.int, v, -1, -2), lead + [n])

    return join(zr), join(zi)


def _c2c(b, p, d, rank, forward: bool):
    xr, xi, back = _last(b, p, d, rank)
    re, im = _dft_last(b, xr, xi, forward)
    return _restore(b, re, im, back, rank)


def _normalize(b, p, normalization: int, n_total: int):
    # ATen's fft_norm_mode: 0 none, 1 by 1/sqrt(n), 2 by 1/n
    if normalization == 1:
        return b.op(aten.mul.Tensor, p, 1.0 / math.sqrt(n_total))
    if normalization == 2:
        return b.op(aten.mul.Tensor, p, 1.0 / n_total)
    return p


@_rule(aten._fft_c2c.default)
def _fft_c2c(b, node):
    x, dims, normalization, forward = node.args
    rank = _rank(x)
    p, total = _c2c_over(b, b.pair(x, _out_dtype(node)), x, [_dim(d, rank) for d in dims], rank, forward)
    return _normalize(b, p, normalization, total)


def _c2c_over(b, p, x, dims, rank, forward: bool):
    """p transformed over each of dims in turn, and the number of points."""
    total = 1
    for d in dims:
        total *= _val(x).shape[d]
        p = _c2c(b, p, d, rank, forward)
    return p, total


@_rule(aten._fft_r2c.default)
def _fft_r2c(b, node):
    x, dims, normalization, onesided = node.args
    rank = _rank(x)
    dt = _out_dtype(node)
    dims = [_dim(d, rank) for d in dims]
    last = dims[-1]
    n = _val(x).shape[last]
    m = n // 2 + 1 if onesided else n
    if n > DIRECT_DFT:  # the complex transform of the real input, its first m bins
        p = b.op(aten.slice.Tensor, _c2c(b, b.pair(x, dt), last, rank, True), last, 0, m)
    else:
        xr = x if _val(x).dtype == dt else b.op(prims.convert_element_type.default, x, dt)
        order, back = _to_last(last, rank)
        moved = b.op(aten.permute.default, xr, order)
        cos, sin = _dft_matrices(b, n, dt, cols=m)
        re = b.op(aten.matmul.default, moved, cos)
        im = b.op(aten.neg.default, b.op(aten.matmul.default, moved, sin))
        p = _restore(b, re, im, back, rank)
    p, total = _c2c_over(b, p, x, dims[:-1], rank, True)
    return _normalize(b, p, normalization, total * n)


@_rule(aten._fft_c2r.default)
def _fft_c2r(b, node):
    x, dims, normalization, n = node.args
    rank = _rank(x)
    dt = _out_dtype(node)
    dims = [_dim(d, rank) for d in dims]
    p, total = _c2c_over(b, b.pair(x, dt), x, dims[:-1], rank, False)
    total *= n
    last = dims[-1]
    bins = n // 2 + 1
    have = _val(x).shape[last]
    if have > bins:
        p = b.op(aten.slice.Tensor, p, last, 0, bins)
    elif have < bins:
        pad = [0, 0] + [0, 0] * (rank - 1 - last) + [0, bins - have]
        p = b.op(aten.constant_pad_nd.default, p, pad)
    if n > DIRECT_DFT:
        # The whole Hermitian spectrum (X[n-k] = conj X[k]), transformed back; its real part.
        mirror = b.conj(b.op(aten.flip.default, b.op(aten.slice.Tensor, p, last, 1, n - bins + 1), [last]))
        full = _c2c(b, b.op(aten.cat.default, [p, mirror], last), last, rank, False)
        return _normalize(b, b.re(full), normalization, total)
    # x_j = sum_k w_k (Re X_k cos(2 pi jk/n) - Im X_k sin(2 pi jk/n)), w_k = 2 but
    # for the bins that are their own mirror (0, and n/2 for even n)
    cos, sin = _dft_matrices(b, n, dt, rows=bins)
    k = b.op(aten.arange.default, bins, dtype=torch.int64)
    mirrored = b.op(aten.logical_or.default, b.op(aten.eq.Scalar, k, 0),
                    b.op(aten.eq.Scalar, b.op(aten.mul.Tensor, k, 2), n))
    w = b.op(aten.where.self, mirrored, b.number(1.0, dt), b.number(2.0, dt))
    w = b.op(aten.unsqueeze.default, w, 1)
    cos, sin = b.op(aten.mul.Tensor, cos, w), b.op(aten.mul.Tensor, sin, w)
    xr, xi, back = _last(b, p, last, rank)
    out = b.op(aten.sub.Tensor, b.op(aten.matmul.default, xr, cos), b.op(aten.matmul.default, xi, sin))
    out = b.op(aten.permute.default, out, back)
    return _normalize(b, out, normalization, total)


# ---- the pass


def to_real_pairs(gm: torch.fx.GraphModule) -> None:
    """Rewrite, in place, every op of an exported graph that touches a complex
    value into ops over real pairs. Placeholders and the graph's outputs keep
    their complex types and names (the exported program's signature refers to
    them); raises NotCompilable for a complex op with no rule."""
    graph = gm.graph
    vals = [n.meta.get("val") for n in graph.nodes]
    fake_mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    if fake_mode is None:
        raise NotCompilable("complex values in a graph without fake tensors")
    pairs: dict = {}
    b = _Builder(graph, fake_mode, pairs)
    nodes = list(graph.nodes)
    first_op = next((n for n in nodes if n.op != "placeholder"), None)
    with graph.inserting_before(first_op):
        for n in nodes:
            if n.op == "placeholder" and _is_complex(n):
                pairs[n] = b.op(aten.view_as_real.default, n)
    for node in nodes:
        if node.op != "call_function" or not _involves_complex(node):
            continue
        rule = _RULES.get(node.target)
        if rule is None:
            raise NotCompilable(f"complex values in {node.target} (no rule for pairs of reals)")
        with graph.inserting_before(node):
            result = rule(b, node)
        val = node.meta["val"]
        if isinstance(val, (list, tuple)):
            pairs[node] = result  # read by its getitem users; the node itself goes dead
        elif val.is_complex():
            pairs[node] = result
            node.target, node.args, node.kwargs = aten.view_as_complex.default, (result,), {}
        else:
            node.replace_all_uses_with(result, delete_user_cb=lambda user: user.op != "output")
            if node.users:  # a graph output: keep its name
                node.target, node.args, node.kwargs = aten.clone.default, (result,), {}
    graph.eliminate_dead_code()
    gm.recompile()
