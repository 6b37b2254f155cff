"""Lowering one op call to MLIR.

The call becomes a small module whose inputs are the call's tensors (or
storage spans), its packed scalars and one destination per new result. The
op's results are copied into the destinations and in-place writes land in the
inputs they target, so torch.export records them as input mutations, which
IREE's importer turns into writes into the caller's buffers
(torch.overwrite.tensor.contents): results need no copy out.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import threading
import warnings
from dataclasses import dataclass

import torch

from .. import trace
from . import complex_pairs, index_checks
from .aliasing import InPlaceHazard, hazardous_inputs
from .call import CallSignature, NotCompilable, numbers_as_tensors, rebuild
from .carriers import as_integer, carrier_dtypes
from .isolation import outside_program_modes
from .rules.float8 import refuse_float8_operands
from .strided import strided_index, strided_view


class NeedsResize(NotCompilable):
    """An out= argument has the wrong shape: resize it (as CPU would), then compile."""

    def __init__(self, shapes: dict):
        super().__init__("the op resizes an argument")
        self.shapes = shapes


_NOISY_LOGGERS = (
    "torch",
    "torch._subclasses.fake_tensor",
    "torch.fx.experimental.symbolic_shapes",
    "torch._export",
    "torch.export",
    "torch._dynamo",
)


@functools.lru_cache(maxsize=1)
def _devnull():
    return open(os.devnull, "w")


@contextlib.contextmanager
def _quiet_torch_logs():
    """torch.export logs (and prints) failed guesses; a failed export is our
    signal to try another way, not something for the user's output."""
    loggers = [logging.getLogger(n) for n in _NOISY_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        # Some failures also print the graph being traced. (Redirecting is
        # process-wide; lowering in the background happens in the worker
        # process, lowering.worker, so only a program thread that is waiting
        # for this lowering anyway lowers here.)
        # The sink stays open: a compile thread that reads sys.stderr meanwhile
        # (iree's tools write the compiler's warnings there) must not meet a
        # closed file.
        sink = _devnull()
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


# One export at a time: torch.export's tracing state and the log levels above
# are shared by the process's threads.
_export_lock = threading.RLock()


from .decompositions import decomposition_table, direct_decompositions, own_decompositions


@dataclass
class LoweredCall:
    mlir: str | None  # None: the call computes nothing (empty results)
    out_specs: tuple  # (shape, dtype) of each new result, allocated by the caller
    flag: int | None  # index in out_specs of the out-of-range-index flag, if the op indexes
    returns: object  # structure of the op's return: ("arg", i) / ("out", j) / None / tuples
    what: str  # "aten.add.Tensor(f32[16], f32[16])" for messages
    # (j, i): input i's new value is written to out_specs[j]; the caller copies
    # it into input i after the launch (lowering/aliasing.py).
    write_back: tuple = ()


def describe(info, sig: CallSignature) -> str:
    shapes = ", ".join(
        f"{str(s.dtype).replace('torch.', '')}{list(s.shape)}" for s in sig.specs
    )
    return f"{info.name}({shapes})"


def _meta(spec):
    if spec.stride is None:
        return torch.empty(spec.shape, dtype=spec.dtype, device="meta")
    return torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype, device="meta")


def _returns_template(result, metas, out_specs: list):
    """Map the op's meta result to argument references and new outputs."""
    if result is None:
        return None
    if isinstance(result, torch.Tensor):
        for i, m in enumerate(metas):
            if result is m:
                return ("arg", i)
        for m in metas:
            if result.untyped_storage()._cdata == m.untyped_storage()._cdata:
                raise NotCompilable("the op returns a view of an argument")
        out_specs.append((tuple(result.shape), result.dtype))
        return ("out", len(out_specs) - 1)
    if isinstance(result, (list, tuple)):
        return (type(result).__name__, tuple(_returns_template(r, metas, out_specs) for r in result))
    raise NotCompilable(f"the op returns a {type(result).__name__}")


def paths_to_outputs(template, path=()):
    if template is None:
        return []
    if template[0] == "out":
        return [(template[1], path)]
    if template[0] == "arg":
        return []
    return [p for i, t in enumerate(template[1]) for p in paths_to_outputs(t, path + (i,))]


def value_at(value, path):
    """The element of a nested result at a path of indices."""
    for i in path:
        value = value[i]
    return value


def promotable_scalars(sig: CallSignature) -> bool:
    """Every tensor is 0-dim and read only: the call can run on 1-element
    tensors instead (same dtypes and type promotion), which the compiler
    takes where it rejects 0-dim reductions and some elementwise ops."""
    return bool(sig.specs) and not sig.mutated and all(len(s.shape) == 0 for s in sig.specs)


def call_results(op, info, sig: CallSignature):
    """(out_specs, returns) of a call, from meta kernels: the (shape, dtype)
    of each new result, and the structure of its return (see
    _returns_template). Raises NeedsResize or NotCompilable."""
    with outside_program_modes():
        return _call_results(op, info, sig)


def _call_results(op, info, sig: CallSignature):
    refuse_float8_operands(op, [s.dtype for s in sig.specs])
    metas = [_meta(s) for s in sig.specs]
    before = [tuple(m.shape) for m in metas]
    try:
        args, kwargs = rebuild_all(sig, metas, sig.floats, sig.ints, _META)
        result = _on_meta(op, *numbers_as_tensors(op, args, kwargs))
    except NotImplementedError as e:
        raise NotCompilable(f"no shape function: {e}") from None
    except (RuntimeError, TypeError) as e:  # TypeError: a meta decomposition refusing None (batch norm's weight)
        raise NotCompilable(f"shape inference failed: {e}") from None
    resized = {i: tuple(m.shape) for i, (m, b) in enumerate(zip(metas, before)) if tuple(m.shape) != b}
    if resized:
        raise NeedsResize(resized)
    result = _as_cpu_results(op, args, result)
    out_specs: list = []
    returns = _returns_template(result, metas, out_specs)
    if (sig.floats or sig.ints) and not _shapes_independent_of_scalars(op, sig, out_specs):
        raise NotCompilable("result shapes depend on scalar arguments")
    return out_specs, returns


def lower_call(op, info, sig: CallSignature, promote_scalars: bool = False) -> LoweredCall:
    with outside_program_modes(), trace.span("lower", info.name):
        return _lower_call(op, info, sig, promote_scalars)


def _lower_call(op, info, sig: CallSignature, promote_scalars: bool) -> LoweredCall:
    what = describe(info, sig)
    out_specs, returns = call_results(op, info, sig)
    outputs = paths_to_outputs(returns)
    if all(math.prod(shape) == 0 for shape, _ in out_specs) and all(
        math.prod(sig.specs[i].shape) == 0 for i in sig.mutated
    ):
        # Nothing to compute (every result is empty): no executable at all.
        return LoweredCall(None, tuple(out_specs), None, returns, what)
    flag = None
    if index_checks.has_checks(op):
        out_specs.append(((), torch.bool))
        flag = len(out_specs) - 1
    try:
        mlir = _export_to_mlir(op, sig, out_specs, outputs, flag, promote_scalars)
        return LoweredCall(mlir, tuple(out_specs), flag, returns, what)
    except InPlaceHazard as e:
        moved = sorted(set(e.inputs))
        if op is torch.ops.aten.copy_.default or not set(moved) <= sig.mutated:
            # (the write-back is a copy_: it must never need one itself)
            raise NotCompilable(str(e)) from None
    write_back = []
    for i in moved:
        out_specs.append((sig.specs[i].shape, sig.specs[i].dtype))
        write_back.append((len(out_specs) - 1, i))
    mlir = _export_to_mlir(op, sig, out_specs, outputs, flag, promote_scalars, tuple(write_back))
    return LoweredCall(mlir, tuple(out_specs), flag, returns, what, tuple(write_back))


# Batch norms in evaluation: PyTorch's CPU kernel returns empty saved
# statistics, the meta kernels full-size ones; results take CPU's shapes (the
# host path gives them too). op -> position of `training` (None: never).
_A = torch.ops.aten
_EVAL_STATISTICS = {
    _A.native_batch_norm.default: 5,
    _A._native_batch_norm_legit.default: 5,
    _A._native_batch_norm_legit_no_training.default: None,
    _A._batch_norm_no_update.default: None,
}


# Normalizations whose saved statistics (results 1 and 2) CPU keeps in the
# input's half-precision dtype unless a parameter is float32 ("mixed": then
# float32); the meta kernels differ (CUDA's convention, float32 for layer and
# batch norm; the input's dtype for group norm). Results take CPU's dtypes,
# which the host path gives too. op -> positions of its parameters.
_HALF_STATISTICS = {
    _A.native_layer_norm.default: (2, 3),
    _A.native_batch_norm.default: (1, 2, 3, 4),
    _A._native_batch_norm_legit.default: (1, 2, 3, 4),
    _A._native_batch_norm_legit.no_stats: (1, 2),
    _A._batch_norm_with_update.default: (1, 2, 3, 4),
    _A.native_group_norm.default: (1, 2),
}


def _as_cpu_results(op, args, result):
    training_at = _EVAL_STATISTICS.get(op, False)
    if training_at is not False and (training_at is None or not args[training_at]):
        empty = [r.new_empty((0,)) for r in result[1:3]]
        result = (result[0], *empty, *result[3:])
    params = _HALF_STATISTICS.get(op)
    if params is None:
        return result
    dtype = args[0].dtype
    if dtype in (torch.float16, torch.bfloat16):
        if any(isinstance(args[p], torch.Tensor) and args[p].dtype == torch.float32 for p in params if p < len(args)):
            dtype = torch.float32
        result = (result[0], *(r.to(dtype) for r in result[1:3]), *result[3:])
    return result


def _on_meta(op, args, kwargs):
    """The op on meta tensors; ops with no meta kernel (geqrf) get their shapes
    from torchneuron's own decomposition, which is what will run."""
    try:
        return op(*args, **kwargs)
    except NotImplementedError:
        own = own_decompositions().get(op)
        if own is None:
            raise
        return own(*args, **kwargs)


def _shapes_independent_of_scalars(op, sig, out_specs) -> bool:
    """Scalars become runtime inputs only if results keep their shapes when
    the scalars change (not so for arange's end): check with other values."""
    metas = [_meta(s) for s in sig.specs]
    floats = [v * 2.0 + 1.5 for v in sig.floats]
    ints = [v * 2 + 3 for v in sig.ints]
    try:
        args, kwargs = rebuild_all(sig, metas, floats, ints, _META)
        result = _on_meta(op, *numbers_as_tensors(op, args, kwargs))
        other: list = []
        _returns_template(result, metas, other)
    except Exception:  # noqa: BLE001 - values the op refuses: treat as dependent
        return False
    return [s for s, _ in other] == [s for s, _ in out_specs]


def rebuild_all(sig, tensors, floats, ints, device):
    args = tuple(rebuild(s, tensors, floats, ints, device) for s in sig.args)
    kwargs = {k: rebuild(s, tensors, floats, ints, device) for k, s in sig.kwargs}
    return args, kwargs


_META = torch.device("meta")
_CPU = torch.device("cpu")

class _CallModule(torch.nn.Module):
    def __init__(self, op, sig: CallSignature, outputs, flag, promote_scalars=False, write_back=()):
        super().__init__()
        self.op = op
        self.sig = sig
        self.outputs = outputs
        self.flag = flag
        self.promote_scalars = promote_scalars
        self.write_back = write_back

    def forward(self, *inputs):
        sig = self.sig
        n = len(sig.specs)
        tensors = []
        written_spans = []
        moved = {i for _, i in self.write_back}
        carriers = carrier_dtypes(sig.specs, sig.mutated - moved)
        for i, spec in enumerate(sig.specs):
            x = as_integer(inputs[i], spec.dtype) if i in carriers else inputs[i]
            if spec.stride is not None:
                x = strided_view(x, spec.shape, spec.stride, spec.prefix)
                if i in sig.mutated and i not in moved:
                    # Writes to a strided view are scattered back into the span below.
                    x = x.clone()
                    written_spans.append((i, x))
            if i in moved:
                x = x.clone()  # the op writes a copy; its value goes to an output
            tensors.append(x)
        pos = n
        floats, ints = [], []
        if sig.floats:
            packed = inputs[pos]
            pos += 1
            floats = [packed[j].item() for j in range(len(sig.floats))]
        if sig.ints:
            packed = inputs[pos]
            pos += 1
            ints = [packed[j].item() for j in range(len(sig.ints))]
        # IREE cannot write a destination straight from an argument or a view
        # of one (copy_, clone, view_copy); a reshape round trip on the inputs
        # the op only reads makes it a real copy, and costs nothing otherwise.
        for i, spec in enumerate(sig.specs):
            if self.promote_scalars:
                tensors[i] = tensors[i].reshape(1)
            elif i not in sig.mutated and tensors[i].numel():
                tensors[i] = tensors[i].unsqueeze(0).squeeze(0)
        args, kwargs = rebuild_all(sig, tensors, floats, ints, _CPU)
        args, kwargs = numbers_as_tensors(self.op, args, kwargs)
        if self.flag is not None:
            args, kwargs, out_of_range = index_checks.apply(self.op, args, kwargs)
            inputs[pos + self.flag].copy_(out_of_range)
        result = direct_decompositions().get(self.op, self.op)(*args, **kwargs)
        for j, path in self.outputs:
            value, destination = value_at(result, path), inputs[pos + j]
            if self.promote_scalars and value.shape != destination.shape:
                value = value.reshape(destination.shape)
            destination.copy_(value)
        for j, i in self.write_back:
            destination = inputs[pos + j]
            destination.copy_(tensors[i].reshape(destination.shape))
        for i, view in written_spans:
            spec = sig.specs[i]
            flat = as_integer(inputs[i], spec.dtype) if i in carriers else inputs[i]
            index = strided_index(spec.shape, spec.stride, spec.prefix, flat.device)
            flat.index_put_((index.reshape(-1),), view.reshape(-1))
        return ()


def _example(spec, dtype):
    if spec.stride is None:
        return torch.zeros(spec.shape, dtype=dtype)
    return torch.zeros(spec.span, dtype=dtype)


def _export_to_mlir(op, sig: CallSignature, out_specs, outputs, flag, promote_scalars=False, write_back=()) -> str:
    carriers = carrier_dtypes(sig.specs, sig.mutated - {i for _, i in write_back})
    examples = [_example(s, carriers.get(i, s.dtype)) for i, s in enumerate(sig.specs)]
    if sig.floats:
        examples.append(torch.tensor(sig.floats, dtype=torch.float64))
    if sig.ints:
        examples.append(torch.tensor(sig.ints, dtype=torch.int64))
    examples += [torch.zeros(shape, dtype=dtype) for shape, dtype in out_specs]
    return export_to_mlir(_CallModule(op, sig, outputs, flag, promote_scalars, write_back), examples)


def export_to_mlir(module: torch.nn.Module, examples: list, dynamic_shapes=None) -> str:
    """A module whose forward writes its results into its inputs -> torch MLIR
    (input mutations become writes into the caller's buffers).
    `dynamic_shapes`: torch.export's, for dimensions that stay dynamic."""
    from iree.compiler.extras.fx_importer import FxImporter

    with _export_lock, outside_program_modes():
        try:
            with warnings.catch_warnings(), _quiet_torch_logs():
                warnings.simplefilter("ignore")
                program = torch.export.export(module, tuple(examples), dynamic_shapes=dynamic_shapes, strict=False)
                program = program.run_decompositions(decomposition_table())
        except Exception as e:  # noqa: BLE001 - export raises many kinds; all mean "not this way"
            raise NotCompilable(f"export failed: {type(e).__name__}: {str(e)[:300]}") from None
        if complex_pairs.graph_has_complex(program.graph_module):
            try:
                complex_pairs.to_real_pairs(program.graph_module)
            except NotCompilable:
                raise
            except Exception as e:  # noqa: BLE001 - a rule that does not fit this call
                raise NotCompilable(f"complex values as pairs of reals: {type(e).__name__}: {str(e)[:300]}") from None
        hazards = hazardous_inputs(program)
        if hazards:
            raise InPlaceHazard(hazards)
        try:
            importer = FxImporter()
            importer.import_program(program, func_name="main")
        except Exception as e:  # noqa: BLE001
            raise NotCompilable(f"import failed: {type(e).__name__}: {str(e)[:300]}") from None
        mlir = importer.module.operation.get_asm(enable_debug_info=False)
    if "torch.overwrite.tensor.contents" not in mlir:
        # Every module lowered here writes its results into its inputs; a
        # trace that recorded no write traced something else (never cache it).
        raise NotCompilable("export recorded no writes of the results")
    return mlir
