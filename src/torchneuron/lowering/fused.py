"""Lowering a recorded graph of op calls to one MLIR module.

The graph mirrors the program's memory: each storage its ops touch is a slot,
held as a flat tensor. Storages that existed before the graph (external slots)
are inputs; storages the graph's ops created (new slots) start as those ops'
results. Every op reads views of slots and its writes are scattered back into
the slot, all functionally, so views and in-place ops need no special case.
At the end, external slots the graph wrote are written back into the caller's
buffers, and new slots whose tensors are still alive are written into their
destinations; the others (intermediates the program dropped) are never written.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from . import index_checks
from .call import numbers_as_tensors, rebuild
from .decompositions import _rounded_to, direct_decompositions
from .graph import export_to_mlir, value_at
from .isolation import outside_program_modes
from .strided import strided_index, strided_view

_CPU = torch.device("cpu")


class ViewRef(NamedTuple):
    """One tensor argument: a view (shape, stride, offset, in elements) of a slot."""

    slot: int
    offset: int
    shape: tuple
    stride: tuple


class SlotSpec(NamedTuple):
    dtype: torch.dtype
    numel: int
    external: bool  # existed before the graph (an input); else created by one of its ops


class GraphOp(NamedTuple):
    op: object  # the aten OpOverload
    args: tuple  # argument structure, leaves TRef/FRef/IRef (lowering.call)
    kwargs: tuple
    views: tuple  # ViewRef per TRef index
    mutated: frozenset  # TRef indices the op writes
    outputs: tuple  # (result path, slot) per new result
    floats: int  # where this op's floats start in the packed float input, and how many
    n_floats: int
    ints: int
    n_ints: int
    checked: bool  # indexes: computes an out-of-range flag


class GraphSpec(NamedTuple):
    slots: tuple  # SlotSpec per slot
    ops: tuple  # GraphOp, in program order
    live: tuple  # new slots written out, in order
    n_floats: int
    n_ints: int

    def external(self) -> list:
        return [i for i, s in enumerate(self.slots) if s.external]

    def written_externals(self) -> list:
        written = {op.views[i].slot for op in self.ops for i in op.mutated}
        return [i for i in self.external() if i in written]

    def flags(self) -> int:
        return sum(op.checked for op in self.ops)


def _contiguous(shape, stride) -> bool:
    expected = 1
    for n, s in zip(reversed(shape), reversed(stride)):
        if n != 1 and s != expected:
            return False
        expected *= n
    return True


def _view(buf, ref: ViewRef):
    n = math.prod(ref.shape)
    if _contiguous(ref.shape, ref.stride):
        if ref.offset == 0 and n == buf.shape[0]:
            return buf.view(ref.shape)
        return buf.narrow(0, ref.offset, n).view(ref.shape)
    return strided_view(buf, ref.shape, ref.stride, ref.offset)


def _scatter(buf, ref: ViewRef, value):
    """buf with the view `ref` replaced by value (functionally)."""
    n = math.prod(ref.shape)
    flat = value.reshape(-1)
    if _contiguous(ref.shape, ref.stride):
        if ref.offset == 0 and n == buf.shape[0]:
            return flat.clone()
        return buf.slice_scatter(flat, 0, ref.offset, ref.offset + n)
    index = strided_index(ref.shape, ref.stride, ref.offset, buf.device)
    return buf.index_put((index.reshape(-1),), flat)


def _as_stored(value):
    """A bfloat16 result as the op path stores it: IREE's CPU codegen drops
    the truncf/extf pair between two bfloat16 ops of one dispatch, so fused
    ops would carry float32 intermediates, and a graph's results would depend
    on where it was cut. Rounding on the bits (idempotent) keeps each op's
    result what it is alone."""
    if value.dtype != torch.bfloat16:
        return value
    return _rounded_to(value.to(torch.float32), torch.bfloat16).to(torch.bfloat16)


class _GraphModule(torch.nn.Module):
    """forward(external slots..., floats?, ints?, live destinations..., flags?)."""

    def __init__(self, spec: GraphSpec):
        super().__init__()
        self.spec = spec

    def forward(self, *inputs):
        spec = self.spec
        externals = spec.external()
        bufs: dict = {}
        pos = 0
        for slot in externals:
            # A reshape round trip: IREE cannot write a destination straight
            # from an argument (see graph._CallModule).
            x = inputs[pos]
            bufs[slot] = x.unsqueeze(0).squeeze(0) if x.numel() else x
            pos += 1
        floats: list = []
        ints: list = []
        if spec.n_floats:
            packed = inputs[pos]
            pos += 1
            floats = [packed[j].item() for j in range(spec.n_floats)]
        if spec.n_ints:
            packed = inputs[pos]
            pos += 1
            ints = [packed[j].item() for j in range(spec.n_ints)]
        flags = []
        for gop in spec.ops:
            tensors = []
            for i, ref in enumerate(gop.views):
                v = _view(bufs[ref.slot], ref)
                tensors.append(v.clone() if i in gop.mutated else v)
            op_floats = floats[gop.floats:gop.floats + gop.n_floats]
            op_ints = ints[gop.ints:gop.ints + gop.n_ints]
            args = tuple(rebuild(s, tensors, op_floats, op_ints, _CPU) for s in gop.args)
            kwargs = {k: rebuild(s, tensors, op_floats, op_ints, _CPU) for k, s in gop.kwargs}
            args, kwargs = numbers_as_tensors(gop.op, args, kwargs)
            if gop.checked:
                args, kwargs, out_of_range = index_checks.apply(gop.op, args, kwargs)
                flags.append(out_of_range.reshape(()))
            result = direct_decompositions().get(gop.op, gop.op)(*args, **kwargs)
            for path, slot in gop.outputs:
                bufs[slot] = _as_stored(value_at(result, path)).reshape(-1)
            for i in sorted(gop.mutated):
                ref = gop.views[i]
                bufs[ref.slot] = _scatter(bufs[ref.slot], ref, _as_stored(tensors[i]))
        written = set(spec.written_externals())
        for k, slot in enumerate(externals):
            if slot in written:
                inputs[k].copy_(bufs[slot])
        for slot in spec.live:
            inputs[pos].copy_(bufs[slot])
            pos += 1
        if flags:
            inputs[pos].copy_(torch.stack(flags))
        return ()


def examples_of(spec: GraphSpec, floats: list, ints: list) -> list:
    examples = [torch.zeros(spec.slots[i].numel, dtype=spec.slots[i].dtype) for i in spec.external()]
    if spec.n_floats:
        examples.append(torch.tensor(floats, dtype=torch.float64))
    if spec.n_ints:
        examples.append(torch.tensor(ints, dtype=torch.int64))
    examples += [torch.zeros(spec.slots[i].numel, dtype=spec.slots[i].dtype) for i in spec.live]
    if spec.flags():
        examples.append(torch.zeros(spec.flags(), dtype=torch.bool))
    return examples


def lower_graph(spec: GraphSpec, floats: list, ints: list) -> str:
    """MLIR for a recorded graph; `floats`/`ints`: one occurrence's runtime
    scalars (examples for tracing; they are inputs of the executable)."""
    with outside_program_modes():
        return export_to_mlir(_GraphModule(spec), examples_of(spec, floats, ints))


def with_ops_named(spec: GraphSpec) -> GraphSpec:
    """The spec with each op as its name (OpOverloads do not pickle)."""
    return spec._replace(ops=tuple(op._replace(op=str(op.op)) for op in spec.ops))


def with_ops_resolved(spec: GraphSpec) -> GraphSpec:
    return spec._replace(ops=tuple(op._replace(op=resolve_op(op.op)) if isinstance(op.op, str) else op
                                   for op in spec.ops))


def resolve_op(name: str):
    """An OpOverload from its str() ("aten.add.Tensor")."""
    namespace, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload)


class Segment(NamedTuple):
    """ops[start:end] of a graph as a graph of its own, and where its inputs
    and results are in the whole graph's slots."""

    spec: GraphSpec
    externals: tuple  # whole-graph slot of each of its inputs, in order
    live: tuple  # whole-graph slot of each result it writes out, in order
    floats: tuple  # (start, end) in the whole graph's packed floats
    ints: tuple


def segment_of(spec: GraphSpec, start: int, end: int) -> Segment:
    """A graph's ops[start:end] alone: slots made earlier are inputs; slots it
    makes are written out when they are live at the end or read later."""
    ops = spec.ops[start:end]
    made = [slot for op in ops for _, slot in op.outputs]
    made_set = set(made)
    used: list = []
    for op in ops:
        for ref in op.views:
            if ref.slot not in made_set and ref.slot not in used:
                used.append(ref.slot)
    read_later = {ref.slot for op in spec.ops[end:] for ref in op.views}
    live = tuple(s for s in made if s in spec.live or s in read_later)
    order = used + made
    renumber = {old: new for new, old in enumerate(order)}
    slots = tuple(
        SlotSpec(spec.slots[old].dtype, spec.slots[old].numel, old not in made_set) for old in order
    )
    f0 = ops[0].floats if ops else 0
    i0 = ops[0].ints if ops else 0
    new_ops = tuple(
        op._replace(
            views=tuple(ref._replace(slot=renumber[ref.slot]) for ref in op.views),
            outputs=tuple((path, renumber[slot]) for path, slot in op.outputs),
            floats=op.floats - f0,
            ints=op.ints - i0,
        )
        for op in ops
    )
    n_floats = sum(op.n_floats for op in ops)
    n_ints = sum(op.n_ints for op in ops)
    sub = GraphSpec(slots, new_ops, tuple(renumber[s] for s in live), n_floats, n_ints)
    return Segment(sub, tuple(used), live, (f0, f0 + n_floats), (i0, i0 + n_ints))
