"""Which inputs an executable must not overwrite in place.

A module that writes a new value into one of its inputs is compiled so that
the value is stored straight into that input's memory. IREE assumes the memory
it writes is not memory the same dispatch still reads, so a dispatch that reads
the input at other positions than it writes (a scan, a flip, a matmul) reads
values it has already overwritten: `x.cumsum_(0)` returned zeros, and
`x.copy_(x.flip(0))` recorded by adaptive eager returned a half-flipped tensor.

An input is safe to overwrite in place when its new value depends on its old
one only element by element: through pointwise ops on same-shaped operands,
dtype conversions, reshapes of the whole tensor, as the base an
index_put/scatter writes into (which IREE updates in place by design), or
through reductions (finished before anything consumes them). Any other
dependency makes it hazardous: the caller computes its new value into
fresh memory and copies it back in a second launch.
"""

from __future__ import annotations

import math

import torch

from .call import NotCompilable

aten = torch.ops.aten
prims = torch.ops.prims

_SAME_ELEMENTS = {  # read element i, write element i (or no data read at all)
    aten.clone.default, aten._to_copy.default, aten.alias.default, aten.lift_fresh_copy.default,
    prims.convert_element_type.default, aten.view.default, aten.view.dtype, aten.reshape.default,
    aten._unsafe_view.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
    aten.unsqueeze.default, aten.detach.default,
}
# Reductions: their result is complete before anything that consumes it writes
# (a reduced dimension is never split across a dispatch's workgroups, and a
# consumer needs the whole result), so what follows them depends on the input
# only through finished values: clip_grad_norm_'s `g *= max_norm / norm(g)`.
_REDUCTIONS = {
    aten.sum.default, aten.sum.dim_IntList, aten.mean.default, aten.mean.dim, aten.amax.default,
    aten.amin.default, aten.max.default, aten.min.default, aten.max.dim, aten.min.dim,
    aten.prod.default, aten.prod.dim_int, aten.any.default, aten.any.dim, aten.any.dims,
    aten.all.default, aten.all.dim, aten.all.dims, aten.var.correction, aten.std.correction,
    aten.var_mean.correction, aten.linalg_vector_norm.default, aten.norm.Scalar, aten.norm.ScalarOpt_dim,
    aten.logsumexp.default, aten.argmax.default, aten.argmin.default,
}
# Ops that take a tensor for its shape, dtype and device only.
_SHAPE_ONLY = {
    aten.full_like.default, aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default,
    aten.rand_like.default, aten.randn_like.default, aten.randint_like.default, aten.new_zeros.default,
    aten.new_ones.default, aten.new_full.default, aten.new_empty.default, aten.new_empty_strided.default,
}
# (op, position of the tensor it updates in place, positions of other inputs that are safe)
_UPDATES_IN_PLACE = {
    aten.index_put.default: 0,
    aten.scatter.src: 0,
    aten.scatter.value: 0,
    aten.scatter_add.default: 0,
    aten.scatter_reduce.two: 0,
    aten.index_copy.default: 0,
    aten.index_add.default: 0,
    aten.masked_scatter.default: 0,
}


class InPlaceHazard(NotCompilable):
    """The module overwrites inputs (their positions: `inputs`) that must get
    their new values through fresh memory instead."""

    def __init__(self, inputs):
        super().__init__(f"inputs {list(inputs)} cannot be overwritten in place (their new values read them "
                         "other than element by element)")
        self.inputs = list(inputs)


def _shape(node):
    value = node.meta.get("val") if hasattr(node, "meta") else None
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _reads_same_elements(node, operand_position: int, operand) -> bool:
    """Does `node` read `operand` (its input at operand_position) only at the
    positions it writes?"""
    target = node.target
    out_shape, in_shape = _shape(node), _shape(operand)
    if out_shape is None or in_shape is None:
        return False
    if target is aten.copy.default:
        # copy(dst, src): dst's values are not read, src's are read in place.
        return operand_position == 0 or in_shape == out_shape
    if target in _UPDATES_IN_PLACE:
        return operand_position == _UPDATES_IN_PLACE[target] and in_shape == out_shape
    if target in _SAME_ELEMENTS:
        return math.prod(in_shape) == math.prod(out_shape)
    tags = getattr(target, "tags", ())
    return torch.Tag.pointwise in tags and in_shape == out_shape


def _operand_positions(node, source):
    for i, a in enumerate(node.args):
        if a is source:
            yield i
        elif isinstance(a, (list, tuple)) and any(x is source for x in a):
            yield -1  # inside a list (cat, index lists): never element by element
    for a in node.kwargs.values():
        if a is source or (isinstance(a, (list, tuple)) and any(x is source for x in a)):
            yield -1


def hazardous_inputs(program) -> list:
    """Positions (among the user inputs) of the inputs `program` (an
    ExportedProgram) overwrites with a value that depends on their old contents
    other than element by element."""
    from torch.export.graph_signature import InputKind, OutputKind

    signature = program.graph_signature
    user_inputs = [s.arg.name for s in signature.input_specs if s.kind == InputKind.USER_INPUT]
    written = {
        s.target: s.arg.name for s in signature.output_specs if s.kind == OutputKind.USER_INPUT_MUTATION
    }
    if not written:
        return []
    nodes = {n.name: n for n in program.graph.nodes}
    hazards = []
    for position, name in enumerate(user_inputs):
        if name not in written:
            continue
        if not element_by_element(nodes[name], nodes[written[name]]):
            hazards.append(position)
    return hazards


def _carries_data(node) -> bool:
    """A node whose value holds tensor data (not a size: sym_size gives shapes)."""
    value = node.meta.get("val", None)
    return value is None or isinstance(value, torch.Tensor) or (
        isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value))


def _data_inputs(node) -> list:
    """The nodes whose values `node` reads: copy(dst, src) reads only src
    (dst gives the shape); sizes are not data."""
    if node.op == "call_function" and node.target is aten.copy.default and _shape(node) == _shape(node.args[1]):
        return [node.args[1]] if hasattr(node.args[1], "op") else []
    if node.op == "call_function" and node.target in _SHAPE_ONLY:
        return []
    return [n for n in node.all_input_nodes if _carries_data(n)]


def element_by_element(source, value) -> bool:
    """Does every dependency of `value` on `source` go element by element?"""
    if value is source:
        return True
    # The nodes on a path from source to value.
    reaches_value = set()
    stack = [value]
    while stack:
        n = stack.pop()
        if n in reaches_value:
            continue
        reaches_value.add(n)
        stack.extend(_data_inputs(n))
    if source not in reaches_value:
        return True  # the new value does not read the old one
    stack, seen = [source], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        for user in n.users:
            if user not in reaches_value or user.op != "call_function" or not _carries_data(user):
                continue
            if user.target in _REDUCTIONS:
                continue  # a finished value from here on
            positions = list(_operand_positions(user, n))
            if not all(p >= 0 and _reads_same_elements(user, p, n) for p in positions):
                return False
            stack.append(user)
    return True
