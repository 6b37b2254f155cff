"""Recording: in adaptive eager mode an op on neuron tensors is appended to its
device's pending graph instead of launching.

Its results are ordinary neuron tensors, allocated at once (data_ptr, views,
aliasing, version counters and autograd behave as in op mode); only their
contents are pending until the graph is cut. What recording needs to know
about a call (result shapes from meta kernels, which arguments it writes, its
argument structure) is a recipe, remembered under the call's cheap key, so an
op met before costs a lookup.

A graph refers to memory by storage: each storage its ops touch is a slot.
Storages that existed before the graph (its inputs) are held; its own
results only weakly, so a result the program drops goes back to the
allocator at once, as in op mode, and later results of the graph may reuse
its memory: at the cut it is a dead intermediate, computed inside the fused
executable and written nowhere (see executor).
"""

from __future__ import annotations

import math
import threading
from operator import itemgetter

import torch

from .. import _C, config, trace
from ..cache.disk import disk_cache
from ..cache.key import plan_id
from ..dispatch import draws_ahead, host_fallback, shape_recording
from ..dispatch import entry as _entry
from ..dispatch.cached_launch import MISS, call_key
from ..dispatch.stats import dispatched
from ..lowering import NotCompilable, index_checks, signature_of
from ..lowering.call import FRef, IRef, Seq, TRef, baked_ops, graph_param_arg_names
from ..lowering.graph import call_results, describe, paths_to_outputs
from ..runtime import generators as neuron_random
from ..runtime import transfers
from ..runtime.errors import is_library_file, user_location
from . import stats

new_output = _C.empty


class Recipe:
    """How to record one kind of call (one cheap key)."""

    __slots__ = ("id", "key", "op", "info", "args", "kwargs", "views", "mutated", "out_specs", "returns",
                 "outputs", "checked", "what", "index", "n_floats", "n_ints", "out_slots")

    def __init__(self, **fields):
        for name, value in fields.items():
            setattr(self, name, value)


class _NotRecordable:
    __slots__ = ("reason",)

    def __init__(self, reason):
        self.reason = reason


class OpRecord(tuple):
    """One recorded op. A tuple, so that the C++ append (csrc/pending_graph.cpp)
    makes one cheaply."""

    __slots__ = ()
    recipe = property(itemgetter(0))
    refs = property(itemgetter(1))  # (slot, storage offset) per tensor argument, flattened
    floats = property(itemgetter(2))
    ints = property(itemgetter(3))
    out_slots = property(itemgetter(4))
    location = property(itemgetter(5))  # (filename, line) of the user's call

    def __new__(cls, recipe, refs, floats, ints, out_slots, location):
        return tuple.__new__(cls, (recipe, refs, floats, ints, out_slots, location))

    def source(self) -> str:
        return f"{self.location[0]}:{self.location[1]}"


# A graph's own result storages are held weakly: a capsule the C++ append
# makes (Weak(storage) here); _weak_get gives the storage, or None once the
# program dropped it.
Weak = _C.weak_storage
_weak_get = _C.weak_get
_WEAK = type(Weak(torch.empty(0).untyped_storage()))


class PendingGraph:
    """The ops recorded on one device's current stream since its last cut."""

    def __init__(self, index: int, stream: int):
        self.index = index
        self.stream = stream  # the stream its launches go to
        self.slot_of: dict = {}  # storage address -> slot
        self.storages: list = []  # slot -> UntypedStorage (an input, held) or Weak (a result)
        self.addresses: list = []
        self.dtypes: list = []
        self.numels: list = []
        self.external: list = []  # slot -> existed before the graph
        self.revived: dict = {}  # at the cut: result slot -> its storage (see storage_for)
        self.live: tuple = ()  # at the cut: the result slots the program still holds
        self.ops: list = []  # OpRecord
        self.identity: list = []  # what makes two graphs the same graph
        self.floats: list = []
        self.ints: list = []
        self.loop_start = 0  # where the graph's first ops seem to begin again (0: nowhere)

    def add_op(self, record) -> None:
        self.ops.append(record)
        self.identity.append((record.recipe.id, record.refs))
        if record.floats:
            self.floats.extend(record.floats)
        if record.ints:
            self.ints.extend(record.ints)

    def split(self, at: int):
        """(ops[:at], ops[at:]) as two graphs of their own. Results of the
        first that the second reads become its inputs, so they must exist:
        one the program dropped gets fresh memory (nothing else sees it)."""
        head, tail = self.ops[:at], self.ops[at:]
        made = {s for rec in head for s in rec.out_slots}
        carried = {}
        for rec in tail:
            for s in rec.refs[0::2]:
                if s in made and s not in carried:
                    storage = _weak_get(self.storages[s])
                    if storage is None:
                        storage = new_output((self.numels[s],), self.dtypes[s], self.index).untyped_storage()
                    carried[s] = storage
        return self._regraph(head, carried), self._regraph(tail, carried)

    def _regraph(self, records, carried):
        graph = PendingGraph(self.index, self.stream)
        new_slot = {}

        def slot(old, external):
            s = new_slot.get(old)
            if s is None:
                storage, address = self.storages[old], self.addresses[old]
                kept = carried.get(old)
                if kept is not None:
                    storage, address = (kept if external else Weak(kept)), kept.data_ptr()
                s = new_slot[old] = graph.add_slot(storage, address, self.dtypes[old], self.numels[old], external)
            return s

        for rec in records:
            refs = list(rec.refs)
            for k in range(0, len(refs), 2):
                refs[k] = slot(refs[k], True)
            outs = [slot(old, False) for old in rec.out_slots]
            graph.add_op(OpRecord(rec.recipe, tuple(refs), rec.floats, rec.ints, outs, rec.location))
        return graph

    def hold_results(self) -> tuple:
        """At the cut: hold the results the program still holds; their slots."""
        live = []
        revived = self.revived
        for i, held in enumerate(self.storages):
            if type(held) is _WEAK:
                storage = _weak_get(held)
                if storage is not None:
                    revived[i] = storage
                    live.append(i)
        self.live = tuple(live)
        return self.live

    def storage_for(self, slot):
        """After hold_results: where a slot's memory is. A result the program
        dropped gets fresh memory, for when it must exist after all (ops run
        one by one, or a boundary between a graph's segments)."""
        held = self.storages[slot]
        if type(held) is not _WEAK:
            return held
        storage = self.revived.get(slot)
        if storage is None:
            storage = self.revived[slot] = new_output((self.numels[slot],), self.dtypes[slot],
                                                      self.index).untyped_storage()
        return storage

    def add_slot(self, storage, address, dtype, numel, external) -> int:
        slot = len(self.storages)
        self.slot_of[address] = slot
        self.storages.append(storage)
        self.addresses.append(address)
        self.dtypes.append(dtype)
        self.numels.append(numel)
        self.external.append(external)
        if external:
            self.identity.append((dtype, numel))
        return slot


_current_stream = _C.current_stream  # (device index) -> the thread's current stream id
_recipes: dict = {}  # cheap key -> Recipe or _NotRecordable
_MAX_RECIPES = 16384
_pending: dict = {}  # device index -> PendingGraph
_next_id = [0]
_lock = threading.Lock()
cut_hook = None  # executor.cut(graph, reason), set by the executor (it sits above this module)


def pending_graph(index: int):
    return _pending.get(index)


def record(op, args, kwargs):
    """The hot path: results of a call whose recipe is known, or MISS."""
    params = _params_of_known.get(op)
    if params is None:
        return MISS
    found = call_key(op, args, kwargs, params)
    if found is None:
        return MISS
    key, tensors, _, floats, ints = found
    recipe = _recipes.get(key)
    if recipe is None or type(recipe) is _NotRecordable:
        return MISS
    _learn(recipe, params, tensors, floats, ints)
    result = _append(recipe, tensors, floats, ints)
    if result is not MISS:
        dispatched[recipe.info.name] += 1
    return result


def _learn(recipe, params, tensors, floats, ints) -> None:
    """Let the C++ entry record calls like this one itself from now on (it
    checks that its key takes the call apart as `call_key` did)."""
    _C.learn_call(_append_known, recipe, recipe.info.name, sorted(params[1]), tensors, floats, ints)


def _append_known(recipe, tensors, floats, ints):
    """What the C++ entry (csrc/recording.cpp) does with a call whose recipe
    it learned, in C++ (append_learned); MISS sends the call on to the
    dispatch entry."""
    return _record_append(recipe, tensors, floats, ints, None)


_params_of_known: dict = {}  # op -> params, once the op has a recipe


# A call met for the first time runs at once on the host (record_slow answers
# FIRST_MEETING): its recipe's meta kernels cost more than running it there,
# and a program's setup meets most of its calls once. From its second
# meeting on it is recorded (from the first with TORCHNEURON_COMPILE_WAIT=1,
# which makes every run fused and the same).
FIRST_MEETING = object()
FIRST_MEETING_CUT = "first meeting"  # the cut reason of the graph pending then
_met: set = set()  # cheap keys of calls met once


def record_slow(op, info, args, kwargs, device):
    """Record a call met for the second time (building its recipe); MISS when
    it cannot be recorded, FIRST_MEETING the first time, after cutting the
    device's graph (so what runs next runs after everything recorded before it)."""
    recipe = _recipe_for(op, info, args, kwargs)
    if recipe is FIRST_MEETING:
        flush(device.index, FIRST_MEETING_CUT)
        return FIRST_MEETING
    if type(recipe) is Recipe:
        params = _params_of_known[op]
        found = call_key(op, args, kwargs, params)
        _learn(recipe, params, found[1], found[3], found[4])
        result = _append(recipe, found[1], found[3], found[4])
        if result is not MISS:
            return result
        reason = "storage-dtype"
    else:
        reason = "unrecordable"
        stats.cut_reasons[f"{reason}: {info.name}"] += 0  # listed even when no graph was pending
    flush(device.index, f"{reason}: {info.name}")
    return MISS


def flush(index, reason: str) -> None:
    """Cut the pending graph of one device (index None: of every device)."""
    if index is None:
        for i in list(_pending):
            flush(i, reason)
        return
    graph = _pending.pop(index, None)
    if graph is not None:
        _C.forget_pending_lists()
        if graph.ops:
            cut_hook(graph, reason)


def _params_of(op, info):
    """Which numbers are runtime inputs, by position and by name (as
    cached_launch's key wants them), for ops inside fused graphs."""
    params = _params_of_known.get(op)
    if params is None:
        if op not in _baked and (info.name in _BAKED_NAMES or info.name in baked_ops or _learned_bake(op)):
            _baked.add(op)
        names = frozenset() if op in _baked else graph_param_arg_names(op)
        params = (tuple(n in names for n in info.arg_names), names)
    return params


_baked: set = set()  # ops whose scalars are constants in fused graphs (found by probing)
_refused: dict = {}  # op -> why it is not recorded (found by probing)
# Ops whose decompositions branch on a scalar's value (a norm's order) or
# convert it in a way the importer cannot lower (masked_fill's value): their
# scalars are constants from the first recording, not after a failed build;
# so are op mode's baked ops (pow: a runtime exponent lowers to exp(y log x),
# NaN for a negative base).
_BAKED_NAMES = frozenset({"aten._foreach_norm.Scalar", "aten.linalg_vector_norm.default", "aten.masked_fill.Scalar"})


def is_baked(op) -> bool:
    return op in _baked


def _bake_id(op):
    # What the importer can lower does not depend on the CPU, and a cold
    # process records before its CPU is resolved.
    return plan_id(("adaptive: scalars baked", str(op)), "any target", ())


def _learned_bake(op) -> bool:
    """Whether probing in an earlier process found that this op's scalars
    must be constants (remembered on disk: a stored graph plan keeps its
    segments, so without it later processes would never fuse the op whole)."""
    disk = disk_cache()
    return disk is not None and disk.get_plan(_bake_id(op)) is not None


def _forget(op) -> None:
    _C.forget_calls(str(op))
    with _lock:
        _params_of_known.pop(op, None)
        for key in [k for k in _recipes if k[0] is op]:
            del _recipes[key]


def bake(op) -> None:
    """From now on, this op's scalars are constants of the graphs it is in
    (remembered on disk for later processes)."""
    _baked.add(op)
    _forget(op)
    disk = disk_cache()
    if disk is not None:
        disk.put_plan(_bake_id(op), {"kind": "bake"})


def refuse(op, reason: str) -> None:
    """From now on, this op is not recorded (it runs on the op path)."""
    _refused[op] = reason
    _forget(op)


def _recipe_for(op, info, args, kwargs):
    params = _params_of(op, info)
    found = call_key(op, args, kwargs, params)
    if found is None:
        return _NotRecordable("arguments the cheap key cannot take")
    key, tensors, _, floats, ints = found
    recipe = _recipes.get(key)
    if recipe is not None:
        return recipe
    if key not in _met and op not in _refused and not config.settings.compile_wait:
        with _lock:
            if len(_met) >= _MAX_RECIPES:
                _met.clear()
            _met.add(key)
        return FIRST_MEETING
    recipe = _build_recipe(op, info, args, kwargs, params, key, tensors, floats, ints)
    with _lock:
        if len(_recipes) >= _MAX_RECIPES:
            del _recipes[next(iter(_recipes))]
        _recipes[key] = recipe
        if type(recipe) is Recipe:
            _params_of_known[op] = params
    return recipe


def _build_recipe(op, info, args, kwargs, params, key, tensors, floats, ints):
    if op in _refused:
        return _NotRecordable(_refused[op])
    if info.seeded or info.metadata_only or not info.host_kernel:
        return _NotRecordable("not an op the host path can replay")
    try:
        sig = signature_of(op, info, args, kwargs, params[1])
        if len(sig.tensors) != len(tensors) or any(a is not b for a, b in zip(tensors, sig.tensors)):
            return _NotRecordable("the cheap key takes the call apart differently")
        if sig.floats != floats or sig.ints != ints:
            return _NotRecordable("the cheap key takes the scalars apart differently")
        if any(s.on_host for s in sig.specs):
            return _NotRecordable("a host tensor argument")
        if any(t.untyped_storage().nbytes() == 0 for t in tensors):
            return _NotRecordable("an argument without memory")
        out_specs, returns = call_results(op, info, sig)
    except NotCompilable as e:  # NeedsResize included: the op path resizes
        return _NotRecordable(str(e))
    if not out_specs and not sig.mutated:
        return _NotRecordable("no results")
    if any(math.prod(shape) == 0 for shape, _ in out_specs):
        return _NotRecordable("an empty result")
    views = tuple((spec.shape, spec.stride if spec.stride is not None else _contiguous_strides(spec.shape))
                  for spec in sig.specs)
    with _lock:
        _next_id[0] += 1
        rid = _next_id[0]
    device = next(t.device for t in tensors) if tensors else None
    if device is None:
        return _NotRecordable("no tensor arguments")
    return Recipe(
        id=rid, key=key, op=op, info=info, args=sig.args, kwargs=sig.kwargs, views=views,
        mutated=sig.mutated, out_specs=tuple(out_specs), returns=returns,
        outputs=tuple(paths_to_outputs(returns)), checked=index_checks.has_checks(op),
        what=describe(info, sig), index=device.index, n_floats=len(floats), n_ints=len(ints),
        out_slots=tuple((shape, dtype, math.prod(shape)) for shape, dtype in out_specs),
    )


def _contiguous_strides(shape) -> tuple:
    strides = []
    step = 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _append(recipe, tensors, floats, ints):
    """Append a call to its device's pending graph (csrc/pending_graph.cpp):
    its results, or MISS when the op path must take it."""
    location = user_location() if trace.sink is not None else None  # (the profiler is told too)
    return _record_append(recipe, tensors, floats, ints, location)


_record_append = _C.record_append


def _fresh_graph(index, stream):
    """A new pending graph for a device; what was recorded on another stream
    is cut first (called by the C++ append)."""
    graph = _pending.pop(index, None)
    if graph is not None:
        _C.forget_pending_lists()
        cut_hook(graph, "stream switch")
    graph = _pending[index] = PendingGraph(index, stream)
    return graph


def _cut_loop(graph):
    """The ops since loop_start repeat the graph's first ones: a loop's next
    iteration. Cutting there gives every iteration the same graphs, where
    the size cap alone would cut elsewhere each time."""
    head, tail = graph.split(graph.loop_start)
    _pending[graph.index] = tail
    cut_hook(head, "loop")


def _cut_size(graph, reason="size"):
    if _pending.get(graph.index) is graph:
        del _pending[graph.index]
    cut_hook(graph, reason)


def _cut_held(graph):
    """The graph holds more inputs the program has dropped than
    config.adaptive_held_kb allows: run it, so their memory is let go."""
    _cut_size(graph, "inputs held")


PEAK_CUT = "memory peak"


def _cut_peak(graph):
    """A cut learned from an earlier iteration (csrc/pending_graph.cpp,
    learn_peak_cut): here the graph's inputs the program drops would lift
    memory past op mode's peak; cut, so they are freed before it."""
    _cut_size(graph, PEAK_CUT)


# (csrc/pending_graph.cpp: a loop body of 4 ops or fewer is not cut out, x = x + x is cut by the
# size cap; 4 ops must repeat the graph's first ones before it is cut there.)
_C.set_recorder_api(_pending, _fresh_graph, _cut_loop, _cut_size, _cut_held, _cut_peak, OpRecord, is_library_file,
                    MISS)
_C.set_fast_path_checks(vars(_entry), vars(trace), vars(shape_recording), config.settings, _append_known,
                        dispatched)


def reset() -> None:
    _C.forget_calls(None)
    _C.forget_peak_cuts()
    with _lock:
        _recipes.clear()
        _params_of_known.clear()
        _met.clear()


__all__ = ["FIRST_MEETING", "FRef", "IRef", "MISS", "Seq", "TRef", "flush", "record", "record_slow"]


# -- random ops ------------------------------------------------------------------
# A random op draws from the device's generator, which PyTorch's CPU kernels
# use (so seeded runs match CPU). Its random draw depends only on shapes, so
# it is made on the host at once, into fresh device memory, and the graph
# records only what uses it: dropout keeps its graph, and each iteration
# meets the same graph with new random values as an input.

_NATIVE_DROPOUT = torch.ops.aten.native_dropout.default
_DROPOUT_ARGS = tuple(a.name for a in _NATIVE_DROPOUT._schema.arguments)  # input, p, train
_COPY = torch.ops.aten.copy_.default
_MUL = torch.ops.aten.mul.Tensor
_MUL_ = torch.ops.aten.mul_.Tensor


def record_random(op, info, args, kwargs, device):
    """Results of a random op with its draw made now, or MISS."""
    if op is _NATIVE_DROPOUT:
        # native_dropout(input, p, train): seven calls a step of the demo,
        # so its arguments are read without building a dict of them.
        if kwargs:
            args = args + tuple(kwargs.get(name) for name in _DROPOUT_ARGS[len(args):])
        x, p = args[0], args[1]
        train = args[2] if len(args) > 2 else None
        if not (train is None or train) or not 0 < p < 1 or not x.dtype.is_floating_point or x.numel() == 0:
            return MISS
        # CPU's kernel: mask ~ bernoulli(1 - p) over a contiguous tensor of
        # the input's shape; output = input * mask * (1 / (1 - p)). Only the
        # draw runs on the host (native_dropout of zeros also multiplied:
        # 634 against 380 us for 8x32x256 floats), most often drawn ahead.
        drawn = draws_ahead.dropout_mask(x.shape, x.dtype, 1.0 - p, neuron_random.default_generator(device.index))
        mask = transfers.device_copy_of(drawn, device.index)  # native_dropout's mask is bool
        out = _MUL(x, mask)
        _MUL_(out, 1.0 / (1.0 - p))
        return out, mask
    target = args[0] if args else None
    if (
        info.mutated_args[:1] != ("self",)
        or not isinstance(target, torch.Tensor)
        or not target.is_contiguous()
        or any(isinstance(a, torch.Tensor) for a in list(args[1:]) + list(kwargs.values()))
    ):
        return MISS
    # An in-place fill (uniform_, normal_, bernoulli_ with a float p...): it reads nothing.
    draw = torch.empty(target.shape, dtype=target.dtype)
    host_fallback.run_seeded(op, (draw,) + tuple(args[1:]), dict(kwargs), device)
    _COPY(target, transfers.device_copy_of(draw, device.index))
    return target
