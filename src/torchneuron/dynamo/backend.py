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
import threading
import warnings

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

from .. import config
from ..compiler import target_flags
from . import stats
from .graph_program import GraphProgram, compile_program, source_lines

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
    compile_graph = functools.partial(_compile_graph, target=target, strict=strict)
    return aot_autograd(
        fw_compiler=functools.partial(compile_graph, kind="forward"),
        bw_compiler=functools.partial(compile_graph, kind="backward"),
        inference_compiler=functools.partial(compile_graph, kind="inference"),
        decompositions=_decompositions(),
        keep_inference_input_mutations=True,
    )(gm, example_inputs)


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


_warned_lock = threading.Lock()


def _compile_graph(gm, example_inputs, *, kind, target, strict):
    try:
        program = GraphProgram(gm, example_inputs, kind)
        compiled = compile_program(program, example_inputs, target)
    except Exception as e:  # noqa: BLE001 - any failure to lower, compile or load: run the graph eagerly
        lines = source_lines(gm)
        reason = _reason(str(e))
        message = (
            f"neuron: a torch.compile {kind} graph ({_op_count(gm)} ops) could not be compiled ({reason}); "
            f"it runs in neuron eager mode instead."
            + (f" Its source lines: {'; '.join(lines[:5])}" if lines else "")
        )
        stats.add("graphs_fallback", 1)
        if strict:
            raise GraphCompileError(message) from None
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        return make_boxed_func(gm)
    stats.add("graphs_compiled", 1)
    if program.dynamic:
        stats.add("graphs_dynamic", 1)
    return compiled


def _reason(text: str) -> str:
    """The line of a lowering or compiler failure that says what went wrong:
    the first compiler `error:` line, else the first line."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    for ln in lines:
        if "error:" in ln:
            return ln[ln.index("error:"):][:400]
    return lines[0][:400] if lines else "unknown failure"


def _op_count(gm) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function")
