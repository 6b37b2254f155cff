"""Conjugate and negative views reaching the backend.

`z.conj()` and `z.imag` of a conjugate are lazy: a bit on the tensor, not a
new value. PyTorch resolves the bits before most ops, but lets a few through
to every backend (copy_, clone, conj_physical, mm/bmm/addmm, dot, ...:
ConjugateFallback.cpp), which must honour them, as CPU's kernels do. The
compiled path reads memory as it is, so those calls get their arguments'
values materialized first, and writes into a conjugate or negative view land
in the memory behind it with the bit applied.
"""

from __future__ import annotations

import torch

# Ops with a fallthrough at the Conjugate or Negative key that compute (views
# keep the bits as metadata and need nothing).
OPS = frozenset(
    op
    for name in (
        "_conj_physical", "conj_physical", "conj_physical_", "copy_", "clone", "neg_", "resolve_conj",
        "resolve_neg", "mm", "bmm", "addmm", "addmm_", "baddbmm", "baddbmm_", "dot", "vdot",
        "linalg_solve_triangular", "linalg_svd", "repeat_interleave",
    )
    for packet in (getattr(torch.ops.aten, name),)
    for op in (getattr(packet, o) for o in packet.overloads())
)

UNCHANGED = object()


def _has_bits(value) -> bool:
    if isinstance(value, torch.Tensor):
        return value.is_conj() or value.is_neg()
    if isinstance(value, (list, tuple)):
        return any(_has_bits(v) for v in value)
    return False


def materialize(t):
    """The values a tensor with math bits stands for, as a new tensor."""
    if isinstance(t, (list, tuple)):
        return type(t)(materialize(v) for v in t)
    if not isinstance(t, torch.Tensor):
        return t
    if t.is_conj():
        t = torch.conj_physical(t.conj())  # conj() clears the bit; the op applies it
    if t.is_neg():
        t = torch.neg(torch._neg_view(t))
    return t


def resolve(op, args, kwargs):
    """The op's result with its arguments' bits honoured, or UNCHANGED when
    no argument has one (the common case, decided cheaply)."""
    if not _has_bits(args) and not any(_has_bits(v) for v in kwargs.values()):
        return UNCHANGED
    if op is torch.ops.aten.copy_.default:
        return _copy(*args, **kwargs)
    schema_args = op._schema.arguments
    written = [
        (i, a.name) for i, a in enumerate(schema_args) if a.alias_info is not None and a.alias_info.is_write
    ]
    targets = [args[i] if i < len(args) else kwargs.get(name) for i, name in written]
    if any(_has_bits(t) for t in targets):
        # Compute into fresh memory, then copy into the views (copy_ applies their bits).
        fresh_args = tuple(materialize(a) if i not in dict(written) else a.clone() for i, a in enumerate(args))
        fresh_kwargs = {k: (v.clone() if any(k == n for _, n in written) else materialize(v)) for k, v in kwargs.items()}
        op(*fresh_args, **fresh_kwargs)
        for (i, name), target in zip(written, targets):
            fresh = fresh_args[i] if i < len(fresh_args) else fresh_kwargs[name]
            target.copy_(fresh)
        return targets[0] if len(targets) == 1 else tuple(targets)
    return op(*materialize(args), **{k: materialize(v) for k, v in kwargs.items()})


def _copy(dest, src, non_blocking=False):
    if dest.is_conj():
        dest.conj().copy_(src.conj(), non_blocking)
    elif dest.is_neg():
        torch._neg_view(dest).copy_(torch._neg_view(src), non_blocking)
    else:
        dest.copy_(materialize(src), non_blocking)
    return dest
