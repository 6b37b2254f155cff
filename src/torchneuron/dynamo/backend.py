"""The torch.compile backend "neuron": TorchDynamo captures the program,
AOTAutograd traces forward and backward graphs in functional ATen with the
decompositions eager mode uses, and each graph becomes one executable
(graph_program). A graph that does not lower or compile runs in neuron eager
mode with one warning naming the reason and its source lines, or raises
under the strict setting.

Options (torch.compile(..., options={...})):
  compiler_flags: extra iree-compile flags (part of the cache key)
  strict: raise GraphCompileError instead of falling back to eager
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

from .. import config
from ..compiler import compile_pool, target_flags
from . import stats
from .graph_program import GraphProgram, compile_program, source_lines
from .pieces import at_opaque_ops, in_pieces, op_count, pieces_expected, pieces_for

_OPTIONS = ("compiler_flags", "strict")


class GraphCompileError(RuntimeError):
    """A torch.compile graph could not be lowered or compiled for neuron (strict setting)."""


def neuron(gm: torch.fx.GraphModule, example_inputs, *, options: dict | None = None, mode: str | None = None):
    """torch.compile(model, backend="neuron", options={...})."""
    options = dict(options or {})
    unknown = set(options) - set(_OPTIONS)
    if unknown:
        raise ValueError(f"neuron backend: unknown options {sorted(unknown)}; known: {', '.join(_OPTIONS)}")
    backend, flags = target_flags()
    target = (backend, tuple(flags) + tuple(options.get("compiler_flags", ())))
    strict = bool(options.get("strict", config.settings.compile_strict))
    stats.add("dynamo_graphs", 1)
    _note_recompile(gm)
    compile_graph = functools.partial(_compile_graph, target=target, strict=strict)
    # The backward graph is handed over with the forward, not at the first
    # backward call, so it lowers while the forward compiles in the pool.
    with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
        return aot_autograd(
            fw_compiler=functools.partial(compile_graph, kind="forward"),
            bw_compiler=functools.partial(compile_graph, kind="backward"),
            inference_compiler=functools.partial(compile_graph, kind="inference"),
            decompositions=_decompositions(),
            keep_inference_input_mutations=True,
        )(gm, example_inputs)


def _note_recompile(gm) -> None:
    """Count recompiles of a frame, and warn when one reaches torch's
    recompile limit: on a compile-first device each recompile costs a
    compile, and past the limit Dynamo runs the frame in eager mode."""
    compile_id = torch._guards.CompileContext.current_compile_id()
    count = getattr(compile_id, "frame_compile_id", None) or 0
    if count == 0:
        return
    stats.add("recompiles", 1)
    limit = torch._dynamo.config.recompile_limit
    if count + 1 == limit:
        lines = source_lines(gm)
        warnings.warn(
            f"neuron: torch.compile has compiled the same frame {limit} times, torch's recompile limit "
            f"(torch._dynamo.config.recompile_limit); later calls that need another compile run in neuron "
            f"eager mode. A size that changes between calls can be marked dynamic "
            f"(torch._dynamo.mark_dynamic, or torch.compile(dynamic=True)); TORCH_LOGS=recompiles lists "
            f"the reasons." + (f" The frame's source lines: {'; '.join(lines[:3])}" if lines else ""),
            RuntimeWarning, stacklevel=2,
        )


@functools.lru_cache(maxsize=None)
def _decompositions() -> dict:
    """PyTorch's core ATen decompositions while AOTAutograd traces; eager
    mode's own table (special functions, linear algebra, ops torch-mlir lacks)
    is applied to each graph when it is lowered, as to each eager op. The
    whole table cannot be used here: its _foreach_ entries redispatch to CPU
    kernels and its tensor-creation entries (lift_fresh, _to_copy) made real
    neuron tensors inside Dynamo's fake tracing (`torch.tensor(..., device=x.device)`)."""
    from torch._decomp import core_aten_decompositions, decomposition_table

    table = dict(core_aten_decompositions())
    # Random ops as rand_like and arithmetic: their values are drawn on the
    # host and passed in (graph_program), the rest compiles.
    aten = torch.ops.aten
    for op in (aten.native_dropout.default, aten.bernoulli.p, aten.bernoulli.default):
        if op in decomposition_table:
            table[op] = decomposition_table[op]
    return table


def _compile_graph(gm, example_inputs, *, kind, target, strict):
    compile_piece = functools.partial(_compile_graph, kind=kind, target=target, strict=strict)
    around_kernels = at_opaque_ops(gm)
    if around_kernels:
        stats.add("graphs_around_kernels", 1)
        return in_pieces(gm, compile_piece, assignment=around_kernels)
    pieces = pieces_expected(gm)
    if pieces:
        stats.add("graphs_split", 1)
        return in_pieces(gm, compile_piece, pieces)
    try:
        program = GraphProgram(gm, example_inputs, kind)
        compiled = compile_program(program, example_inputs, target, compile_pool().submit)
    except Exception as e:  # noqa: BLE001 - any failure to lower: run the graph eagerly
        return _fall_back(gm, kind, e, strict)
    return _FirstCallWaits(compiled, gm, kind, target, strict)


class _FirstCallWaits:
    """A graph whose compile runs in the pool: its first call waits for it
    and, if the compile or the load failed, runs the graph in neuron eager
    from then on (boxed calling convention, as AOTAutograd expects). A graph
    the runtime refused for its size is compiled again in pieces (pieces.py)."""

    def __init__(self, compiled, gm, kind, target, strict):
        self._boxed_call = True
        self._compiled, self._gm, self._kind, self._target, self._strict = compiled, gm, kind, target, strict
        self._run = self._first

    def __call__(self, inputs):
        return self._run(inputs)

    def _first(self, inputs):
        compiled = self._compiled
        try:
            compiled.ready()
        except Exception as e:  # noqa: BLE001 - any failure to compile or load: run the graph eagerly
            pieces = pieces_for(e, self._gm)
            if pieces:
                stats.add("graphs_split", 1)
                self._run = in_pieces(self._gm, functools.partial(
                    _compile_graph, kind=self._kind, target=self._target, strict=self._strict), pieces)
            else:
                self._run = _fall_back(self._gm, self._kind, e, self._strict)
        else:
            stats.add("graphs_compiled", 1)
            if compiled.program.dynamic:
                stats.add("graphs_dynamic", 1)
            self._run = compiled
        self._compiled = None
        return self._run(inputs)


def _fall_back(gm, kind, error, strict):
    """Neuron eager for a graph that did not compile: one warning naming the
    reason and the graph's source lines, or GraphCompileError when strict."""
    lines = source_lines(gm)
    message = (
        f"neuron: a torch.compile {kind} graph ({op_count(gm)} ops) could not be compiled ({_reason(str(error))}); "
        f"it runs in neuron eager mode instead."
        + (f" Its source lines: {'; '.join(lines[:5])}" if lines else "")
    )
    stats.add("graphs_fallback", 1)
    if strict:
        raise GraphCompileError(message) from None
    warnings.warn(message, RuntimeWarning, stacklevel=3)
    return make_boxed_func(_views_as_reshapes(gm))


def _views_as_reshapes(gm):
    """The graph with its views as reshapes, to run in eager mode. AOTAutograd
    traced it on fake tensors whose strides follow CPU kernels, so it views
    wherever those strides allow; a neuron result may be laid out otherwise
    (compiled graphs and eager ops return contiguous results), and a view of
    it would fail ("view size is not compatible with input tensor's size and
    stride"). The graph is functional, so a copy where a view cannot be is
    the same program."""
    aten = torch.ops.aten
    views = (aten.view.default, aten._unsafe_view.default)
    changed = False
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in views:
            node.target = aten.reshape.default
            changed = True
    if changed:
        gm.recompile()
    return gm


def _reason(text: str) -> str:
    """The line of a lowering or compiler failure that says what went wrong:
    the first compiler `error:` line, else the first line."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    for ln in lines:
        if "error:" in ln:
            return ln[ln.index("error:"):][:400]
    return lines[0][:400] if lines else "unknown failure"

