"""One AOTAutograd graph (forward or backward, functional ATen) as one
executable: the same lowering (torch.export to torch MLIR), compiler, cache
layers and runtime queue as eager mode.

The executable's inputs are the graph's tensor inputs, then its random
inputs (values of its random ops, drawn on the host from the neuron
generator, as eager mode draws them), then one destination per new result:
results are written into buffers allocated by the caller, and in-place
updates of inputs (BatchNorm's running statistics, kept in the graph by
AOTAutograd) land in the caller's buffers.

Dynamic dimensions (mark_dynamic, dynamic=True, automatic dynamic) stay
dynamic in the MLIR: one executable serves every size; result shapes are
evaluated from the graph's symbolic shapes with the sizes of each call.
"""

from __future__ import annotations

import functools
import hashlib
import operator
import re
from concurrent.futures import Future
from dataclasses import dataclass

import sympy
import torch
import torch.fx

from .. import config, trace
from ..cache import executable_cache, executables
from ..cache.disk import disk_cache
from ..cache.key import plan_id
from ..dispatch import draws_ahead
from ..dispatch.cached_launch import new_output
from ..lowering import NotCompilable
from ..lowering.aliasing import element_by_element
from ..lowering.graph import export_to_mlir
from ..lowering.isolation import outside_program_modes
from ..lowering.rules.float8 import refuse_float8_graph
from ..runtime import LoadedExecutable, device_queue
from ..runtime import generators as neuron_random
from ..runtime.queue import queue_recorded
from . import flex_attention

_NEURON = "neuron"
_CPU = torch.device("cpu")

# Random ops whose tensor arguments give only shape and dtype: their values
# are drawn on the host and passed in (IREE has no generator of PyTorch's).
_RANDOM_LIKE = {
    torch.ops.aten.rand_like.default: torch.rand,
    torch.ops.aten.randn_like.default: torch.randn,
}
_RANDOM_NEW = {torch.ops.aten.rand.default, torch.ops.aten.randn.default}


@dataclass
class _Random:
    """A random op of the graph; its values are an input of the executable."""

    draw: object  # torch.rand / torch.randn
    shape: tuple  # may hold sympy expressions of the graph's sizes
    dtype: torch.dtype


class GraphProgram:
    """The parts of one FX graph the runtime needs, decided once at compile time."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs, kind: str):
        self.kind = kind
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.tensor_inputs = []  # positions of tensor inputs
        self.symbols = {}  # sympy symbol -> ("dim", input position, dim) or ("int", input position, None)
        self.constants = {}  # input position -> a number input's value (it is baked in)
        int_inputs = []
        for pos, (node, example) in enumerate(zip(self.placeholders, example_inputs)):
            if isinstance(example, torch.Tensor):
                self.tensor_inputs.append(pos)
                for d, size in enumerate(example.shape):
                    if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                        self.symbols.setdefault(size.node.expr, ("dim", pos, d))
            elif isinstance(example, torch.SymInt):
                int_inputs.append((pos, example))
            elif isinstance(example, (int, float, bool, type(None))):
                self.constants[pos] = example
            else:
                raise NotCompilable(f"graph input of type {type(example).__name__}")
        # Size inputs are computed from tensor shapes inside the executable.
        self.size_inputs = {}  # input position -> sympy expression of tensor input sizes
        for pos, example in int_inputs:
            expr = example.node.expr
            missing = [sym for sym in expr.free_symbols if sym not in self.symbols]
            if missing:
                raise NotCompilable(f"size input {expr} is not computable from the tensor inputs' sizes")
            self.size_inputs[pos] = expr
        self.dynamic = bool(self.symbols)
        refuse_float8_graph(gm)
        self.gm = _on_cpu(gm)
        self.randoms = _take_randoms(self.gm)
        self.n_returned = _output_count(self.gm)
        self.write_back = _updates_as_results(self.gm)
        self._outputs(self.gm)
        self.what = _describe(gm, kind)
        self._members = None

    def members(self) -> tuple:
        """(op, "file:line") of each op with a source line, for the profiler."""
        if self._members is None:
            found = []
            for node in self.gm.graph.nodes:
                line = _user_frame(node) if node.op == "call_function" else None
                m = re.match(r'File "([^"]+)", line (\d+)', line) if line else None
                if m:
                    found.append((str(node.target), f"{m.group(1)}:{m.group(2)}"))
            self._members = tuple(found)
        return self._members

    def _outputs(self, gm) -> None:
        """How each graph output is produced: ("input", position), ("new",
        destination index), ("same", output index), ("value", constant) or
        ("sym", sympy expression)."""
        output = next(n for n in gm.graph.nodes if n.op == "output")
        values = output.args[0]
        values = [values] if not isinstance(values, (tuple, list)) else list(values)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        placeholder_pos = {n: i for i, n in enumerate(placeholders[:len(self.placeholders)])}
        seen: dict = {}
        self.outputs = []
        self.new = []  # (output index, shape, dtype, device) per destination
        for i, value in enumerate(values):
            if not isinstance(value, torch.fx.Node):
                self.outputs.append(("value", value))
            elif value in placeholder_pos:
                self.outputs.append(("input", placeholder_pos[value]))
            elif value in seen:
                self.outputs.append(("same", seen[value]))
            else:
                seen[value] = i
                meta = value.meta.get("val")
                if isinstance(meta, torch.Tensor):
                    shape = tuple(_expr(s) for s in meta.shape)
                    self.outputs.append(("new", len(self.new)))
                    self.new.append((i, shape, meta.dtype, meta.device))
                elif isinstance(meta, torch.SymInt):
                    self.outputs.append(("sym", _expr(meta)))
                elif isinstance(meta, (int, float, bool)):
                    self.outputs.append(("value", meta))
                else:
                    raise NotCompilable(f"graph output {value.name} is a {type(meta).__name__}")

    # -- compile ----------------------------------------------------------

    def lower(self, example_inputs) -> str | None:
        """Torch MLIR of the graph; None when it computes nothing."""
        with outside_program_modes(), trace.span("lower", "torch.compile graph"):
            return self._lower(example_inputs)

    def _lower(self, example_inputs) -> str | None:
        if not self.new and not _mutates_inputs(self.gm):
            return None
        module = _ProgramModule(self.gm, self.placeholders, self.tensor_inputs, len(self.randoms),
                                [i for i, *_ in self.new], self.size_inputs, self.constants, self.symbols)
        examples = [_boundary(_example(example_inputs[p])) for p in self.tensor_inputs]
        sizes = self.sizes_of(example_inputs)
        examples += [torch.zeros(_evaluate(r.shape, sizes), dtype=r.dtype) for r in self.randoms]
        examples += [_boundary(torch.zeros(_evaluate(shape, sizes), dtype=dtype)) for _, shape, dtype, _ in self.new]
        dynamic_shapes = self._dynamic_shapes(examples) if self.dynamic else None
        # forward(*inputs) takes its inputs as one variadic argument.
        return export_to_mlir(module, examples, dynamic_shapes=(dynamic_shapes,) if dynamic_shapes else None)

    def _dynamic_shapes(self, examples) -> tuple:
        """torch.export's Dims for every dimension that depends on a size
        symbol (derived dims such as 2*s0 included). The range starts at 2,
        as Dynamo's does (sizes 0 and 1 are specialized)."""
        dims = {symbol: torch.export.Dim(str(symbol), min=2) for symbol in self.symbols}
        spec = []
        shapes = [self._input_shape(p) for p in self.tensor_inputs]
        shapes += [r.shape for r in self.randoms] + [shape for _, shape, *_ in self.new]
        for shape in shapes:
            spec.append({d: _as_dim(s, dims) for d, s in enumerate(shape) if not isinstance(s, int)} or None)
        return tuple(spec)

    def _input_shape(self, pos) -> tuple:
        meta = self.placeholders[pos].meta.get("val")
        return tuple(_expr(s) for s in meta.shape) if isinstance(meta, torch.Tensor) else ()

    def identity(self, example_inputs) -> str:
        """The graph's stable text: its code, input layouts (symbolic sizes
        by name), tensor constants, random inputs and write-backs. Equal
        identities lower to the same module."""
        h = hashlib.sha256(self.gm.code.encode())
        for pos, node in enumerate(self.placeholders):
            meta = node.meta.get("val")
            if isinstance(meta, torch.Tensor):
                h.update(f"{pos}:{meta.dtype}:{tuple(map(str, meta.shape))}:{meta.device.type}".encode())
            else:
                h.update(f"{pos}:{type(meta).__name__}:{self.constants.get(pos)!r}".encode())
        for node in self.gm.graph.nodes:
            if node.op == "get_attr":
                value = _attribute(self.gm, node.target)
                if isinstance(value, torch.Tensor):
                    h.update(f"{node.target}:{value.dtype}:{tuple(value.shape)}".encode())
                    h.update(value.detach().contiguous().numpy().tobytes() if value.dtype != torch.bfloat16
                             else value.detach().float().numpy().tobytes())
        h.update(repr([(r.draw.__name__, tuple(map(str, r.shape)), str(r.dtype)) for r in self.randoms]).encode())
        h.update(repr((self.write_back, self.n_returned, sorted(self.symbols, key=str))).encode())
        return h.hexdigest()

    def sizes_of(self, inputs) -> dict:
        """symbol -> its value in this call."""
        sizes = {}
        for symbol, (kind, pos, d) in self.symbols.items():
            value = inputs[pos]
            sizes[symbol] = _concrete(value.shape[d] if kind == "dim" else value)
        return sizes


def _expr(size):
    if isinstance(size, torch.SymInt):
        expr = size.node.expr
        return int(expr) if expr.is_number else expr
    return int(size)


def evaluate_size(expr, sizes):
    """A sympy size expression evaluated on `sizes` (symbol -> int, SymInt
    or export Dim): sums, products, powers, floor division and modulo."""
    if isinstance(expr, sympy.Symbol):
        return sizes[expr]
    if expr.is_Integer:
        return int(expr)
    args = [evaluate_size(a, sizes) for a in expr.args]
    if isinstance(expr, sympy.Add):
        return functools.reduce(operator.add, args)
    if isinstance(expr, sympy.Mul):
        return functools.reduce(operator.mul, args)
    if isinstance(expr, sympy.Pow) and expr.args[1].is_Integer:
        return functools.reduce(operator.mul, [args[0]] * int(expr.args[1]))
    name = type(expr).__name__
    if name == "FloorDiv":
        return args[0] // args[1]
    if name in ("Mod", "PythonMod"):
        return args[0] % args[1]
    raise NotCompilable(f"size expression {expr} ({name}) is not supported")


def _as_dim(expr, dims):
    try:
        return evaluate_size(expr, dims)
    except (TypeError, NotCompilable):
        raise NotCompilable(f"dimension {expr} is not expressible for torch.export") from None


def _evaluate(shape, sizes) -> tuple:
    return tuple(s if isinstance(s, int) else int(s.subs(sizes)) for s in shape)


# 0-dim tensors cross the executable's boundary as 1-element tensors: the
# importer cannot write a 0-dim integer input in place (BatchNorm's
# num_batches_tracked: "failed to legalize unresolved target materialization
# from tensor<si64> to tensor<i64>"), and a view back to 0-dim is free.
def _boundary(t):
    return t.reshape(1) if t.dim() == 0 else t


def _boundary_shape(shape) -> tuple:
    return tuple(shape) if len(shape) else (1,)


def _concrete(size) -> int:
    """A size's value in this call; for a symbolic size at compile time, its
    hint (int() would specialize the graph to it)."""
    if isinstance(size, torch.SymInt):
        hint = size.node.hint
        if hint is None:
            raise NotCompilable(f"size {size} has no example value")
        return int(hint)
    return int(size)


def _example(value):
    if isinstance(value, torch.Tensor):
        return torch.zeros([_concrete(s) for s in value.shape], dtype=value.dtype)
    return _concrete(value) if isinstance(value, torch.SymInt) else value


def _on_cpu(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of the graph whose factory ops build CPU tensors: the graph is
    traced on CPU example tensors for export (devices are the caller's)."""
    # A copy of the graph, not of its metadata (deep-copying the symbolic
    # example values would guard on their sizes, specializing them).
    graph = torch.fx.Graph()
    output = graph.graph_copy(gm.graph, {})
    graph.output(output)
    gm = torch.fx.GraphModule(gm, graph)
    for module in [gm, *(m for m in gm.modules() if m is not gm and isinstance(m, torch.fx.GraphModule))]:
        _factories_on_cpu(module)  # subgraphs too: FlexAttention's score_mod and mask_mod
    return gm


def _factories_on_cpu(gm: torch.fx.GraphModule) -> None:
    for node in gm.graph.nodes:
        if node.op == "get_attr":  # a tensor constant (torch.tensor(...) in the program)
            value = _attribute(gm, node.target)
            if isinstance(value, torch.Tensor) and value.device.type != "cpu":
                with outside_program_modes():  # a real tensor: not under Dynamo's fake mode
                    _set_attribute(gm, node.target, value.detach().cpu())
        if node.op != "call_function":
            continue
        device = node.kwargs.get("device")
        if isinstance(device, torch.device) and device.type != "cpu":
            node.kwargs = {**node.kwargs, "device": _CPU}
        if node.target is torch.ops.aten._to_copy.default and "device" in node.kwargs:
            node.kwargs = {k: v for k, v in node.kwargs.items() if k != "device"}
        dense = flex_attention.dense_attention().get(node.target)
        if dense is not None:
            node.target = dense
    gm.recompile()


def _attribute(module, target: str):
    for name in target.split("."):
        module = getattr(module, name)
    return module


def _set_attribute(module, target: str, value) -> None:
    *path, name = target.split(".")
    for part in path:
        module = getattr(module, part)
    if isinstance(getattr(module, name, None), torch.nn.Parameter):
        value = torch.nn.Parameter(value, requires_grad=False)
    if name in module._buffers:
        module._buffers[name] = value
    else:
        setattr(module, name, value)


def _take_randoms(gm: torch.fx.GraphModule) -> list:
    """Replace the graph's random ops by inputs (placed after its tensor
    inputs); refuse random ops that read values (none reach here after
    AOTAutograd's decompositions, which turn dropout into rand_like)."""
    randoms = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    last = placeholders[-1] if placeholders else None
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        draw = _RANDOM_LIKE.get(node.target)
        if draw is None and node.target in _RANDOM_NEW:
            draw = torch.rand if node.target is torch.ops.aten.rand.default else torch.randn
        if draw is None:
            if torch.Tag.nondeterministic_seeded in node.target.tags:
                raise NotCompilable(f"random op {node.target} in the graph")
            continue
        meta = node.meta["val"]
        with gm.graph.inserting_after(last) if last is not None else gm.graph.inserting_before(None):
            value = gm.graph.placeholder(f"random_{len(randoms)}")
        value.meta["val"] = meta
        last = value
        node.replace_all_uses_with(value)
        gm.graph.erase_node(node)
        randoms.append(_Random(draw, tuple(_expr(s) for s in meta.shape), meta.dtype))
    gm.recompile()
    return randoms


def _output_count(gm) -> int:
    values = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    return len(values) if isinstance(values, (tuple, list)) else 1


def _updates_as_results(gm) -> list:
    """In-place updates that IREE cannot compile or run in place become extra
    results, copied into the inputs after the launch: those of integer inputs
    (BatchNorm's num_batches_tracked: IREE 3.13 fails with "failed to legalize
    unresolved target materialization from tensor<si64> to tensor<i64>"), and
    those whose new value reads the input other than element by element
    (lowering/aliasing.py). Returns (input position, output index) pairs."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    values = output.args[0]
    values = list(values) if isinstance(values, (tuple, list)) else [values]
    moved = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.copy_.default or node.users:
            continue
        target = node.args[0]
        meta = target.meta.get("val") if target in placeholders else None
        if isinstance(meta, torch.Tensor) and (
            not (meta.dtype.is_floating_point or meta.dtype.is_complex)
            or not element_by_element(target, node.args[1])
        ):
            values.append(node.args[1])
            moved.append((placeholders.index(target), len(values) - 1))
            gm.graph.erase_node(node)
    if moved:
        output.args = (tuple(values),)
        gm.recompile()
    return moved


def _mutates_inputs(gm) -> bool:
    placeholders = {n for n in gm.graph.nodes if n.op == "placeholder"}
    return any(
        n.op == "call_function" and n.target is torch.ops.aten.copy_.default and n.args[0] in placeholders
        for n in gm.graph.nodes
    )


class _ProgramModule(torch.nn.Module):
    """forward(tensor inputs..., random values..., destinations...): runs the
    graph and copies each new result into its destination."""

    def __init__(self, gm, placeholders, tensor_inputs, n_random, new_outputs, size_inputs, constants, symbols):
        super().__init__()
        self.symbols = symbols
        self.scalars = {pos for pos in tensor_inputs if _placeholder_dim(placeholders[pos]) == 0}
        self.gm = gm
        self.n_placeholders = len(placeholders)
        self.tensor_inputs = tensor_inputs
        self.n_random = n_random
        self.new_outputs = new_outputs
        self.size_inputs = size_inputs
        self.constants = constants

    def forward(self, *inputs):
        n = len(self.tensor_inputs)
        args = [None] * self.n_placeholders
        by_position = dict(zip(self.tensor_inputs, inputs[:n]))
        for pos, x in by_position.items():
            # A reshape round trip: IREE cannot write a destination straight
            # from an argument or a view of one (see lowering.graph); views
            # keep in-place updates of inputs landing in the inputs.
            if pos in self.scalars:
                args[pos] = x.view(())  # see _boundary
            else:
                args[pos] = x.unsqueeze(0).squeeze(0) if x.numel() else x
        if self.size_inputs:
            sizes = {symbol: by_position[pos].shape[d] for symbol, (_, pos, d) in self.symbols.items()}
            for pos, expr in self.size_inputs.items():
                args[pos] = evaluate_size(expr, sizes)
        for pos, value in self.constants.items():
            args[pos] = value
        randoms = inputs[n:n + self.n_random]
        destinations = inputs[n + self.n_random:]
        results = self.gm(*args, *randoms)
        if not isinstance(results, (tuple, list)):
            results = (results,)
        for i, destination in zip(self.new_outputs, destinations):
            value = results[i]
            destination.copy_(value.reshape(1) if value.dim() == 0 else value)
        return ()


def _placeholder_dim(node):
    meta = node.meta.get("val")
    return meta.dim() if isinstance(meta, torch.Tensor) else None


def _describe(gm, kind) -> str:
    """"torch.compile forward graph (178 ops) from models.py:86": what the
    cache (`torchneuron cache list`, `explain`) and errors call it."""
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]
    text = f"torch.compile {kind} graph ({len(ops)} ops)"
    lines = source_lines(gm)
    if lines:
        m = re.match(r'File "(?:.*/)?([^/"]+)", line (\d+)', lines[0])
        if m:
            text += f" from {m.group(1)}:{m.group(2)}"
    return text


def source_lines(gm) -> list:
    """The user's source lines the graph's ops came from, in order, once each."""
    lines = []
    for node in gm.graph.nodes:
        line = _user_frame(node)
        if line is not None and line not in lines:
            lines.append(line)
    return lines


def _user_frame(node) -> str | None:
    """The innermost 'File "...", line N, in f' line of a node's stack trace."""
    frames = [ln.strip() for ln in (node.meta.get("stack_trace") or "").strip().splitlines()
              if ln.strip().startswith("File ")]
    return frames[-1] if frames else None


class CompiledGraph:
    """Runs a GraphProgram's executable on the device queue (boxed calling
    convention: one list of inputs)."""

    def __init__(self, program: GraphProgram, pending: Future | None, index: int):
        # An instance attribute: wrappers (functools.wraps) copy __dict__.
        self._boxed_call = True
        self.program = program
        self.executable = None
        self._pending = pending  # the compile; None: nothing to compile (the graph only forwards values)
        self._index = index

    def ready(self) -> None:
        """Wait for the compile and load the executable; raises what the
        compile raised, or NotCompilable when the runtime refuses it."""
        if self._pending is None:
            return
        executable = self._pending.result()
        _load(executable, self._index)
        self.executable, self._pending = executable, None

    def __call__(self, inputs):
        self.ready()
        program = self.program
        inputs = list(inputs)
        tensors = [inputs[p] for p in program.tensor_inputs]
        index = _device_index(tensors, program)
        sizes = program.sizes_of(inputs) if program.dynamic else {}
        results: list = [None] * len(program.outputs)
        new = []
        if self.executable is not None:
            queue_recorded(index, "compiled graph")
            new = self._launch(tensors, index, sizes)
        for i, (kind, value) in enumerate(program.outputs):
            if kind == "input":
                results[i] = inputs[value]
            elif kind == "new":
                results[i] = new[value] if new else _empty_result(program.new[value], sizes, index)
            elif kind == "same":
                results[i] = results[value]
            elif kind == "sym":
                results[i] = int(value.subs(sizes))
            else:
                results[i] = value
        for pos, j in program.write_back:
            inputs[pos].copy_(results[j])  # queued after the launch
        return results[:program.n_returned]

    def _launch(self, tensors, index, sizes) -> list:
        program = self.program
        queue = device_queue(index)
        bound, keepalive, write_back = [], [], []
        for t in tensors:
            if not t.is_contiguous():
                contiguous = t.contiguous()
                write_back.append((t, contiguous))
                t = contiguous
            keepalive.append(t)
        largest = max((t.numel() for t in keepalive), default=0)
        touched = sum(t.numel() for t in keepalive)
        outs = []
        for _, shape, dtype, device in program.new:
            shape = _evaluate(shape, sizes)
            out = new_output(shape, dtype, index) if device.type == _NEURON else torch.empty(shape, dtype=dtype)
            outs.append(out)
            largest = max(largest, out.numel())
            touched += out.numel()
        # In adaptive eager mode the graph runs on the device's workers unless
        # it is as small as a tiny op, as a fused eager graph does: the program
        # records what follows (the optimizer's ops after the backward graph)
        # while it runs. In op mode the next eager op would wait for it on the
        # host, and the handoff to the workers costs more than it gains (the
        # demo step measured 7.2-7.5 -> 8.0 ms; adaptive 7.0-7.2 -> 5.9-6.5 ms).
        lane = queue.lane_for(touched if config.settings.eager_mode == "adaptive" else largest)
        imp = lane.import_memory
        for t in keepalive:
            bound.append(imp(t, t.storage_offset() * t.dtype.itemsize, _boundary_shape(t.shape), t.dtype))
        generator = neuron_random.default_generator(index)
        for r in program.randoms:
            # torch.rand/randn from the neuron generator, as CPU draws them; in a
            # loop most often drawn ahead, beside the program (dispatch/draws_ahead.py).
            kind = draws_ahead.UNIFORM if r.draw is torch.rand else draws_ahead.NORMAL
            values = draws_ahead.draw(kind, _evaluate(r.shape, sizes), r.dtype, 0.0, generator)
            keepalive.append(values)
            bound.append(imp(values, 0, tuple(values.shape), values.dtype))
        for out in outs:
            bound.append(imp(out, 0, _boundary_shape(out.shape), out.dtype))
        keepalive.append(outs)
        what = program.what
        if trace.sink is not None:  # the profiler shows the graph's ops with their lines
            what = trace.Traced(what, program.members())
        queue.launch(self.executable, bound, keepalive, what, None, lane)
        for original, contiguous in write_back:
            original.copy_(contiguous)  # an input the graph updates in place
        if any(t.device.type != _NEURON for t in keepalive[:len(tensors)]) or any(
            o.device.type != _NEURON for o in outs
        ):
            queue.synchronize()  # host tensors are read or written by the program at once
        return outs


def _device_index(tensors, program) -> int:
    index = None
    for t in tensors:
        if t.device.type == _NEURON:
            if index is None:
                index = t.device.index or 0
            elif t.device.index != index:
                raise RuntimeError(
                    f"neuron: {program.what} got tensors on neuron:{index} and neuron:{t.device.index}"
                )
    return 0 if index is None else index


def _empty_result(spec, sizes, index):
    _, shape, dtype, device = spec
    shape = _evaluate(shape, sizes)
    if device.type == _NEURON:
        return new_output(shape, dtype, index)
    return torch.empty(shape, dtype=dtype)


def compile_program(program: GraphProgram, example_inputs, target: tuple, submit) -> CompiledGraph:
    """Lower here, then compile (through every cache layer) through `submit`
    (a pool's), so a backward graph lowers while its forward
    compiles; the graph's first call waits for it (CompiledGraph.ready).
    Raises NotCompilable for what fails to lower. A graph lowered before (by
    this or another process) is not lowered again: its executable's key is a
    plan on disk under the graph's identity."""
    disk = disk_cache()
    pid = None
    if disk is not None:
        with outside_program_modes():  # its constants are real tensors: not under Dynamo's fake mode
            pid = plan_id(("torch.compile graph", program.identity(example_inputs)), *target)
    executable = _from_plan(disk.get_plan(pid), program) if pid is not None else None
    index = _device_index([example_inputs[p] for p in program.tensor_inputs], program)
    if executable is not None:
        return CompiledGraph(program, _done(executable), index)
    mlir = program.lower(example_inputs)
    if mlir is None:
        return CompiledGraph(program, None, index)

    def compile_graph():
        executable = executables.executable_for(mlir, program.what, target)
        if pid is not None:
            disk.put_plan(pid, {"kind": "torch.compile graph", "executable": executable.key})
        return executable

    return CompiledGraph(program, submit(compile_graph), index)


def _done(value) -> Future:
    future = Future()
    future.set_result(value)
    return future


def _from_plan(record, program):
    """The executable a stored plan names, from memory or disk; None if gone."""
    if not record or record.get("kind") != "torch.compile graph":
        return None
    key = record.get("executable")
    executable = executable_cache().get(key) if key else None
    if executable is None and key:
        vmfb = disk_cache().get_executable(key)
        if vmfb is None:
            return None
        executable, _ = executable_cache().put(key, LoadedExecutable(vmfb, key, program.what), len(vmfb))
    return executable


def _load(executable, index) -> None:
    """Load the executable on its device's queue before the first launch:
    the runtime refuses some executables the compiler made (a dispatch with
    more than 64 bindings, as a compiled optimizer step over many parameters
    has), and that must fall back, not fail inside the launch."""
    try:
        for lane in device_queue(index).lanes():
            executable.entry(lane)
    except (RuntimeError, IndexError, ValueError) as e:
        raise NotCompilable(f"the runtime cannot load it: {str(e).splitlines()[0][:300]}") from None


__all__ = ["CompiledGraph", "GraphProgram", "compile_program"]
