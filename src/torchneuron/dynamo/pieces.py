"""A graph whose executable the runtime refuses is compiled again in pieces,
each its own executable, instead of running in eager mode.

The case that needs it: IREE gathers every small (one-element) computation of
a module into a single dispatch, and the runtime passes at most 32 buffers to
a dispatch. A compiled optimizer step keeps a step counter per parameter, so
over a dozen parameters that dispatch has more (3 buffers per parameter for
Adam) and the whole step would run op by op.

Pieces follow the graph's independent computations (a parameter's update
does not read another's), so no piece waits for another and each piece's
counters are a share of the whole; a graph that is one computation is cut
into consecutive runs of ops instead.
"""

from __future__ import annotations

import math
import operator
import re

import torch
from torch._functorch.aot_autograd import make_boxed_func
from torch.fx.passes.split_module import split_module

from ..lowering.opaque import is_opaque

_BINDINGS = re.compile(r"binding count (\d+) > (\d+)")
_MIN_OPS = 2  # a graph this small is not split further
_MAX_BINDINGS = 32  # what IREE's runtime passes to one dispatch


def pieces_for(error: BaseException, gm: torch.fx.GraphModule) -> int:
    """How many pieces a graph the runtime refused with `error` should be
    compiled as; 0 when splitting it would not help."""
    m = _BINDINGS.search(str(error))
    if not m or op_count(gm) < 2 * _MIN_OPS:
        return 0
    count, limit = int(m.group(1)), int(m.group(2))
    # Twice the bare ratio: pieces are balanced by ops, not by buffers.
    return max(2, math.ceil(2 * count / limit))


def pieces_expected(gm: torch.fx.GraphModule) -> int:
    """Pieces for a graph whose one-element computations would need more
    buffers than a dispatch takes, known before compiling it whole (which
    would be wasted); 0 when it should compile whole. Each one-element input
    such a computation reads (a step counter) costs that dispatch about 3
    buffers: itself, its update and a value derived for the others. A graph
    that needs more pieces than this gives is split again when refused."""
    counters = sum(
        1 for node in gm.graph.nodes
        if node.op == "placeholder" and _one_element(node) and any(_one_element(u) for u in node.users))
    if 3 * counters <= _MAX_BINDINGS or op_count(gm) < 2 * _MIN_OPS:
        return 0
    return max(2, math.ceil(2 * 3 * counters / _MAX_BINDINGS))


def _one_element(node) -> bool:
    val = node.meta.get("val") if node.op != "output" else None
    return isinstance(val, torch.Tensor) and all(isinstance(s, int) for s in val.shape) and val.numel() <= 1


def at_opaque_ops(gm: torch.fx.GraphModule):
    """node -> piece for a graph that calls operators which run as themselves
    (kernels): each such call a piece of its own, run eagerly, and the runs
    of ops between them pieces to compile; None when it calls none."""
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]
    if not any(is_opaque(n.target) for n in ops):
        return None
    assignment, piece = {}, 0
    for n in ops:
        if is_opaque(n.target):
            piece += 1
            assignment[n] = piece
            for user in n.users:  # its results unpacked with it: a piece passes tensors, not tuples
                if user.op == "call_function" and user.target is operator.getitem:
                    assignment[user] = piece
            piece += 1
        elif n not in assignment:
            assignment[n] = piece
    return assignment


def in_pieces(gm: torch.fx.GraphModule, compile_piece, pieces: int = 0, assignment: dict | None = None):
    """The graph as graphs run in turn: `pieces` of them, or as `assignment`
    (node -> piece) says. `compile_piece(gm, examples)` gives each piece's
    boxed callable; a piece of operators that run as themselves runs
    eagerly. Returns the boxed callable of the whole."""
    if assignment is None:
        gm = _per_tensor(gm)
        assignment = _partition(gm, pieces)
    split = split_module(gm, gm, lambda node: assignment.get(node, 0), keep_original_order=True, tuple_return=True)
    for name, piece in list(split.named_children()):
        if not isinstance(piece, torch.fx.GraphModule):
            continue
        calls = [n for n in piece.graph.nodes if n.op == "call_function"]
        if any(is_opaque(n.target) for n in calls):
            split._modules[name] = _Piece(make_boxed_func(piece))
            continue
        examples = [n.meta.get("val") for n in piece.graph.nodes if n.op == "placeholder"]
        split._modules[name] = _Piece(compile_piece(piece, examples))

    def run(inputs):
        args = list(inputs)
        inputs.clear()  # boxed convention: the callee owns the list
        result = split(*args)
        return list(result) if isinstance(result, (tuple, list)) else [result]

    run._boxed_call = True
    return run


class _Piece(torch.nn.Module):
    """A piece's compiled callable (boxed) where split_module calls a module."""

    def __init__(self, boxed):
        super().__init__()
        self.boxed = boxed

    def forward(self, *args):
        return tuple(self.boxed(list(args)))


def _per_tensor(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of the graph with each _foreach_ op as one op per tensor (what
    export makes of them later anyway): a foreach op joins every parameter's
    update into one computation, which could not be split."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    gm = torch.fx.GraphModule(gm, graph)
    changed = False
    for node in list(gm.graph.nodes):
        per = _per_tensor_calls(node)
        if per is None:
            continue
        with gm.graph.inserting_before(node):
            new = []
            for op, args, kwargs, val in per:
                call = gm.graph.call_function(op, tuple(args), kwargs)
                call.meta = dict(node.meta, val=val)
                new.append(call)
        for user in list(node.users):
            user.replace_all_uses_with(new[user.args[1]])
            gm.graph.erase_node(user)
        gm.graph.erase_node(node)
        changed = True
    if changed:
        gm.recompile()
    return gm


def _per_tensor_calls(node):
    """[(op, args, kwargs, result)] doing a functional _foreach_ op's work one
    tensor at a time, each checked on the node's example values; None when
    the node is not such an op or a call would not match its result."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    name = target._schema.name
    if not name.startswith("aten::_foreach_") or name.endswith("_"):
        return None
    op = getattr(torch.ops.aten, name[len("aten::_foreach_"):], None)
    results = node.meta.get("val")
    users = list(node.users)
    if op is None or not isinstance(results, (list, tuple)) or not all(
            u.op == "call_function" and u.target is operator.getitem and isinstance(u.args[1], int) for u in users):
        return None
    arguments = target._schema.arguments
    values = dict(zip((a.name for a in arguments), node.args), **node.kwargs)
    lists = {a.name for a in arguments if isinstance(a.type, torch.ListType) and a.name in values}
    keyword = {a.name for a in arguments if a.kwarg_only}
    calls = []
    for i, result in enumerate(results):
        positional = [values[a.name][i] if a.name in lists else values[a.name]
                      for a in arguments if a.name in values and a.name not in keyword]
        kwargs = {k: values[k] for k in keyword if k in values}
        call = _checked(op, positional, kwargs, result)
        if call is None:
            return None
        calls.append(call + (result,))
    return calls


def _checked(op, args, kwargs, result):
    """(op, args, kwargs) if calling op so gives `result`'s shape and dtype
    on the example values; the last plain argument may be the op's keyword
    (addcmul's `value`). None when neither form matches."""
    forms = [(args, kwargs)]
    if args and not isinstance(args[-1], torch.fx.Node):
        for overload in op.overloads():
            schema = getattr(op, overload)._schema
            kw = [a.name for a in schema.arguments if a.kwarg_only and a.name not in kwargs]
            if kw:
                forms.append((args[:-1], dict(kwargs, **{kw[0]: args[-1]})))
                break
    for a, k in forms:
        try:
            out = op(*_vals(a), **_vals(k))
        except Exception:  # noqa: BLE001 - that form does not fit this op
            continue
        if isinstance(out, torch.Tensor) and out.shape == result.shape and out.dtype == result.dtype:
            return op, list(a), k
    return None


def _vals(value):
    if isinstance(value, torch.fx.Node):
        return value.meta.get("val")
    if isinstance(value, (list, tuple)):
        return type(value)(_vals(v) for v in value)
    if isinstance(value, dict):
        return {k: _vals(v) for k, v in value.items()}
    return value


def op_count(gm) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function")


def _partition(gm: torch.fx.GraphModule, pieces: int) -> dict:
    """node -> piece: independent computations balanced over the pieces by
    their op counts, or consecutive runs of ops when there are too few."""
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]
    parent = {n: n for n in ops}

    def root(n):
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for n in ops:
        for arg in n.all_input_nodes:
            if arg in parent:  # inputs and constants do not join computations
                parent[root(n)] = root(arg)
    groups: dict = {}
    for n in ops:
        groups.setdefault(root(n), []).append(n)
    assignment = {}
    if len(groups) >= pieces:
        loads = [0] * pieces
        for members in sorted(groups.values(), key=len, reverse=True):
            lightest = loads.index(min(loads))
            loads[lightest] += len(members)
            for n in members:
                assignment[n] = lightest
    else:
        size = math.ceil(len(ops) / pieces)
        for i, n in enumerate(ops):
            assignment[n] = i // size
    return assignment


__all__ = ["at_opaque_ops", "in_pieces", "op_count", "pieces_expected", "pieces_for"]
