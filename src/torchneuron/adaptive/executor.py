"""Cutting a pending graph and running it: never stall on a compile.

At the cut, the graph's results the program no longer holds (the graph
holds them only weakly) are dead intermediates: they are left out of the
fused executable's results, and their memory went back to the allocator
when the program dropped them. The
graph's identity (its ops, argument layouts, slot structure and live results;
scalars are runtime inputs) names its fused executable:

- ready: one launch of the fused executable;
- not built yet: the ops run one by one now (tier 2: per-op executables
  already in memory, else the host path, PyTorch's kernels on the same
  memory) while the fused executable is lowered and compiled in the
  background, through every cache layer; later occurrences use it;
- failed to build: marked bad (on disk too, so other processes skip it), and
  its ops run one by one through the op path (compiling per op).

TORCHNEURON_COMPILE_WAIT=1 waits for every build instead.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

import torch

from .. import _C, config, trace
from ..cache import executable_cache, executables, layers
from ..cache.disk import disk_cache
from ..cache.key import plan_id
from ..compiler import says_nothing_about_the_module, target_flags
from ..compiler.pool import background_pool, default_workers
from ..dispatch import eager, host_fallback, host_threads
from ..dispatch import stats as op_stats
from ..lowering import NotCompilable
from ..lowering.call import numbers_as_tensors, rebuild
from ..lowering.fused import GraphOp, GraphSpec, SlotSpec, ViewRef, segment_of
from ..lowering.worker import lower_graph_elsewhere
from ..lowering.graph import value_at
from ..runtime import LoadedExecutable, device_queue, transfers
from ..runtime.errors import NeuronAsyncError
from . import recorder, stats

_READY, _BUILDING, _BAD = "ready", "building", "bad"


class Unit:
    """One fused executable over ops[start:end] of a graph (the whole graph,
    or a segment of one that did not compile whole); executable None: those
    ops run one by one through the op path."""

    __slots__ = ("start", "end", "executable", "externals", "live", "floats", "ints", "what", "largest", "touched")

    def __init__(self, start, end, executable, externals, live, floats, ints, what, largest, touched):
        self.start, self.end, self.executable = start, end, executable
        self.externals, self.live, self.floats, self.ints = externals, live, floats, ints
        self.what, self.largest = what, largest
        self.touched = touched  # elements of every tensor its ops read or write, dead ones too


class FusedGraph:
    __slots__ = ("state", "units", "reason", "future", "what", "n_ops", "dead_bytes")

    def __init__(self, n_ops):
        self.dead_bytes = None  # results not written per launch (fixed by the identity)
        self.state = _BUILDING
        self.units = []  # ready: Units covering ops[0:n_ops] in order
        self.reason = ""
        self.future = None
        self.what = ""
        self.n_ops = n_ops


_fused: OrderedDict = OrderedDict()  # identity -> FusedGraph
_MAX_FUSED = 4096
_builder = None
_builder_lock = threading.Lock()


def _build_pool():
    """Background threads build fused graphs: each has its graph lowered in
    the worker process (lowering.worker, one graph at a time) and compiles
    it, at a lower scheduling priority than the program. One per core (as op
    mode's builds): one graph lowers while another compiles (a cold demo's
    9 graphs landed after 55 s with one thread)."""
    global _builder
    with _builder_lock:
        if _builder is None:
            _builder = background_pool("neuron-adaptive-build", default_workers())
        return _builder


def cut(graph, reason: str) -> None:
    """Run a detached pending graph (see the module docstring) on the stream
    it was recorded on."""
    previous = _C.exchange_stream(graph.index, graph.stream)
    try:
        _run_graph(graph, reason)
    finally:
        _C.exchange_stream(graph.index, previous)


def _run_graph(graph, reason: str) -> None:
    stats.cut_reasons[reason] += 1
    n = len(graph.ops)
    stats.add("graphs_cut", 1)
    stats.add("ops_recorded", n)
    if n > stats.largest_graph:
        stats.largest_graph = n
    live = graph.hold_results()
    identity = (tuple(graph.identity), live)
    fused = _fused.get(identity)
    if fused is None and not config.settings.compile_wait and (
            reason == recorder.FIRST_MEETING_CUT or _met_first(identity)):
        # Built from its second meeting on: a graph cut short by a call met
        # for the first time is a fragment the next iteration will not meet
        # again, and so are most graphs of a loop's first iterations, before
        # the loop's cuts settle (the cold demo built 14 graphs, 6 of which
        # came back; the lowering worker, one graph at a time, spent most of
        # its minute on the other 8).
        _replay(graph, 0, n, allow_compile=False)
        stats.launches["op"] += 1
        return
    if fused is None:
        fused = FusedGraph(n)
        if len(_fused) >= _MAX_FUSED:
            _fused.popitem(last=False)
        _fused[identity] = fused
        _submit_build(fused, graph, live)
    if fused.state is _BUILDING and config.settings.compile_wait:
        started = time.perf_counter()
        try:
            fused.future.result()
        except Exception:  # noqa: BLE001 - the build marks the graph bad
            pass
        stats.add("compile_seconds_exposed", time.perf_counter() - started)
    if fused.state is _READY:
        for unit in fused.units:
            if unit.executable is not None:
                _launch_unit(graph, unit, reason)
            else:
                _replay(graph, unit.start, unit.end, allow_compile=True)
        stats.launches["fused" if len(fused.units) == 1 else "segmented"] += 1
        dead = fused.dead_bytes
        if dead is None:
            dead = fused.dead_bytes = sum(graph.numels[i] * graph.dtypes[i].itemsize
                                          for i, ext in enumerate(graph.external) if not ext and i not in live)
        if dead:
            stats.add("bytes_not_written", dead)
    else:
        _replay(graph, 0, n, allow_compile=fused.state is _BAD)
        stats.launches["op"] += 1


# -- the fused executable -----------------------------------------------------

class _FusedWhat:
    """A fused launch's description; names the op whose index check failed."""

    __slots__ = ("text", "checked")

    def __init__(self, text, checked):
        self.text = text
        self.checked = checked  # (what, source) of each op with an index check, in flag order

    def __str__(self):
        return self.text

    def culprit(self, flags):
        hits = flags.nonzero()
        i = int(hits[0, 0]) if len(hits) else 0
        what, source = self.checked[i]
        return f"{what} (in a fused graph: {self.text})", source


def _launch_unit(graph, unit, reason) -> None:
    index = graph.index
    queue = device_queue(index)
    # A fused graph runs on the device's worker threads, beside the program
    # that records the next one, unless it is as small as a tiny op: the
    # handoff (a command buffer of all its dispatches, about 0.1 ms for 70)
    # would then cost more than running it inline (the demo step 1.5x -> 1.3x
    # CPU eager; 1000 tiny adds 2.9x -> 3.8x if they went too). A graph cut to
    # keep memory below op mode's peak runs as op mode's ops would: inline
    # when small, so the inputs it was cut to let go are let go at once.
    lane = queue.lane_for(unit.largest if reason == recorder.PEAK_CUT else unit.touched)
    imp = lane.import_at
    dtypes, numels, storage_for = graph.dtypes, graph.numels, graph.storage_for
    held = [storage_for(i) for i in unit.externals]
    bound = [imp(s.data_ptr(), (numels[i],), dtypes[i]) for s, i in zip(held, unit.externals)]
    keepalive = [held]
    floats = graph.floats[unit.floats[0]:unit.floats[1]]
    if floats:
        packed, view = lane.import_numbers(floats, torch.float64, index)
        keepalive.append(packed)
        bound.append(view)
    ints = graph.ints[unit.ints[0]:unit.ints[1]]
    if ints:
        packed, view = lane.import_numbers(ints, torch.int64, index)
        keepalive.append(packed)
        bound.append(view)
    for i in unit.live:
        storage = storage_for(i)
        held.append(storage)
        bound.append(imp(storage.data_ptr(), (numels[i],), dtypes[i]))
    ops = graph.ops[unit.start:unit.end]
    checked = [op for op in ops if op.recipe.checked]
    flag = None
    what = unit.what
    if checked:
        flag = _C.empty((len(checked),), torch.bool, index)
        keepalive.append(flag)
        bound.append(lane.import_memory(flag, 0, (len(checked),), torch.bool))
        what = _FusedWhat(unit.what, [(op.recipe.what, op.source()) for op in checked])
    if trace.sink is not None:  # the profiler shows each op of the graph with its line
        what = trace.Traced(what, tuple((op.recipe.info.name, op.source()) for op in ops))
    queue.launch(unit.executable, bound, keepalive, what, flag, lane, ops[0].source())
    stats.add("ops_fused", len(ops))
    compiled = op_stats.compiled
    for op in ops:
        compiled[op.recipe.info.name] += 1


def spec_of(graph, live) -> GraphSpec:
    slots = tuple(SlotSpec(d, n, e) for d, n, e in zip(graph.dtypes, graph.numels, graph.external))
    ops = []
    nf = ni = 0
    for rec in graph.ops:
        r = rec.recipe
        refs = rec.refs
        views = tuple(
            ViewRef(refs[2 * k], refs[2 * k + 1], shape, stride) for k, (shape, stride) in enumerate(r.views)
        )
        outputs = tuple((path, rec.out_slots[j]) for j, path in r.outputs)
        ops.append(GraphOp(r.op, r.args, r.kwargs, views, r.mutated, outputs, nf, r.n_floats, ni, r.n_ints,
                           r.checked))
        nf += r.n_floats
        ni += r.n_ints
    return GraphSpec(slots, tuple(ops), live, nf, ni)


def _describe(ops) -> str:
    names = [op.recipe.info.name.replace("aten.", "") for op in ops]
    shown = ", ".join(names[:6]) + (f", ... ({len(names)} ops)" if len(names) > 6 else "")
    return f"fused graph [{shown}] from {ops[0].source()}"


_met_once: set = set()  # identities of graphs met once and not built


def _met_first(identity) -> bool:
    """Whether this is the first meeting of a graph (remembered)."""
    if identity in _met_once:
        _met_once.discard(identity)
        return False
    if len(_met_once) >= 4 * _MAX_FUSED:
        _met_once.clear()
    _met_once.add(identity)
    return True


def _submit_build(fused, graph, live) -> None:
    spec = spec_of(graph, live)
    floats, ints = list(graph.floats), list(graph.ints)
    fused.what = _describe(graph.ops)
    stable = (tuple((op.recipe.key, op.refs) for op in graph.ops), tuple(graph.identity), live)
    fused.future = _build_pool().submit(_build, fused, spec, floats, ints, stable, graph.ops)


def _build(fused, spec, floats, ints, stable, ops) -> None:
    """Build a graph's fused executable; when it does not build, build halves
    of it (recursively), so a graph with one op that cannot fuse still runs
    fused around it. The outcome is remembered on disk for other processes."""
    started = time.perf_counter()
    target = target_flags()
    disk = disk_cache()
    pid = plan_id(stable, *target) if disk is not None else None
    try:
        record = disk.get_plan(pid) if pid is not None else None
        units = _units_from_record(record, spec, ops, disk) if record is not None else None
        if units is None:
            units = []
            _build_range(spec, floats, ints, ops, 0, len(spec.ops), target, units, fused, top=True)
            if pid is not None and not says_nothing_about_the_module(fused.reason):
                disk.put_plan(pid, {"kind": "graph", "units": [[u.start, u.end, u.executable.key if u.executable
                                                                 else None] for u in units]})
        fused.units = units
        if len(units) == 1 and units[0].executable is not None:
            stats.add("graphs_compiled", 1)
        elif all(u.executable is None for u in units):
            stats.add("graphs_failed", 1)
        else:
            stats.add("graphs_segmented", 1)
        fused.state = _READY
    except Exception as e:  # noqa: BLE001 - any failure: the ops run one by one
        fused.reason = f"{type(e).__name__}: {str(e)[:500]}"
        fused.state = _BAD
        stats.add("graphs_failed", 1)
    finally:
        stats.add("compile_seconds_hidden", time.perf_counter() - started)


_MIN_SEGMENT = 2  # below this, ops run one by one


def _build_range(spec, floats, ints, ops, start, end, target, units, fused, top=False) -> None:
    segment = segment_of(spec, start, end)
    try:
        executable = _compile_segment(segment, floats, ints, _describe(ops[start:end]), target)
    except NotCompilable as e:
        if top:
            fused.reason = str(e)[:500]
            _probe_ops(spec, floats, ints)
        if end - start < 2 * _MIN_SEGMENT:
            units.append(_unit(start, end, None, segment, ops))
            return
        middle = (start + end) // 2
        _build_range(spec, floats, ints, ops, start, middle, target, units, fused)
        _build_range(spec, floats, ints, ops, middle, end, target, units, fused)
        return
    units.append(_unit(start, end, executable, segment, ops))


def _unit(start, end, executable, segment, ops) -> Unit:
    sizes = [segment.spec.slots[i].numel for i in segment.spec.external()] + [
        segment.spec.slots[i].numel for i in segment.spec.live
    ]
    return Unit(start, end, executable, segment.externals, segment.live, segment.floats, segment.ints,
                _describe(ops[start:end]), max(sizes, default=0), sum(slot.numel for slot in segment.spec.slots))


def _compile_segment(segment, floats, ints, what, target):
    mlir = lower_graph_elsewhere(segment.spec, floats[segment.floats[0]:segment.floats[1]],
                                 ints[segment.ints[0]:segment.ints[1]])
    return executables.executable_for(mlir, what, target, show_progress=False)


def _units_from_record(record, spec, ops, disk):
    """The units a stored outcome describes; None when it cannot be used."""
    try:
        if record.get("kind") != "graph":
            return None
        units = []
        for start, end, key in record["units"]:
            segment = segment_of(spec, start, end)
            executable = None
            if key is not None:
                executable = executable_cache().get(key)
                if executable is None:
                    vmfb = disk.get_executable(key)
                    if vmfb is None:
                        return None
                    executable, _ = executable_cache().put(key, LoadedExecutable(vmfb, key, "fused graph"),
                                                           len(vmfb))
                    layers.stats.add("disk")
            units.append(_unit(start, end, executable, segment, ops))
        return units
    except (KeyError, TypeError, ValueError):
        return None


def _probe_ops(spec, floats, ints) -> None:
    """After a graph failed to lower: lower each kind of op in it alone, so
    the next recordings leave out what cannot fuse. An op that fails with
    runtime scalars is retried with them as constants (its scalars are baked
    from then on); one that fails either way is no longer recorded."""
    seen = set()
    for gop in spec.ops:
        name = str(gop.op)
        if name in seen or recorder.is_baked(gop.op):
            continue
        seen.add(name)
        alone, op_floats, op_ints = _alone(gop, spec, floats, ints)
        try:
            lower_graph_elsewhere(alone, op_floats, op_ints)
            continue
        except NotCompilable:
            pass
        if gop.n_floats or gop.n_ints:
            recorder.bake(gop.op)
        else:
            recorder.refuse(gop.op, "fails to lower inside a fused graph")


def _alone(gop, spec, floats, ints):
    """A graph of one op, each tensor argument its own input."""
    slots = []
    views = []
    for ref in gop.views:
        extent = 1 + sum((n - 1) * s for n, s in zip(ref.shape, ref.stride)) if all(ref.shape) else 1
        slots.append(SlotSpec(spec.slots[ref.slot].dtype, extent, True))
        views.append(ViewRef(len(slots) - 1, 0, ref.shape, ref.stride))
    outputs = []
    for path, slot in gop.outputs:
        slots.append(SlotSpec(spec.slots[slot].dtype, spec.slots[slot].numel, False))
        outputs.append((path, len(slots) - 1))
    op_floats = floats[gop.floats:gop.floats + gop.n_floats]
    op_ints = ints[gop.ints:gop.ints + gop.n_ints]
    alone = GraphOp(gop.op, gop.args, gop.kwargs, tuple(views), gop.mutated, tuple(outputs), 0, gop.n_floats, 0,
                    gop.n_ints, gop.checked)
    live = tuple(slot for _, slot in outputs)
    return GraphSpec(tuple(slots), (alone,), live, gop.n_floats, gop.n_ints), op_floats, op_ints


# -- one op at a time -----------------------------------------------------------

def _replay(graph, start: int, end: int, allow_compile: bool) -> None:
    """Run ops[start:end] of a graph one by one, into the tensors recording handed out."""
    device = torch.device("neuron", graph.index)
    bases: dict = {}

    def base(slot):
        b = bases.get(slot)
        if b is None:
            b = bases[slot] = torch.empty(0, dtype=graph.dtypes[slot], device=device).set_(graph.storage_for(slot))
        return b

    ends = _dead_ends(graph)
    for i in range(start, end):
        rec = graph.ops[i]
        r = rec.recipe
        refs = rec.refs
        tensors = [
            base(refs[2 * k]).as_strided(shape, stride, refs[2 * k + 1]) for k, (shape, stride) in enumerate(r.views)
        ]
        outs = [base(slot).view(shape) for slot, (shape, _) in zip(rec.out_slots, r.out_specs)]
        args = tuple(rebuild(s, tensors, rec.floats, rec.ints, device) for s in r.args)
        kwargs = {k: rebuild(s, tensors, rec.floats, rec.ints, device) for k, s in r.kwargs}
        _run_one(r, rec, args, kwargs, outs, device, allow_compile)
        done = ends.get(i)
        if done:  # dead intermediates no later op of the graph uses: their memory goes back now, as in op mode
            del tensors, outs, args, kwargs
            for slot in done:
                bases.pop(slot, None)
                graph.revived.pop(slot, None)


def _dead_ends(graph) -> dict:
    """op index -> the dead intermediates (results the program dropped) that
    op is the graph's last to use."""
    live = set(graph.live)
    last = {}
    for i, rec in enumerate(graph.ops):
        for slot in rec.refs[0::2]:
            last[slot] = i
        for slot in rec.out_slots:
            last[slot] = i
    ends: dict = {}
    for slot, i in last.items():
        if not graph.external[slot] and slot not in live:
            ends.setdefault(i, []).append(slot)
    return ends


def _run_one(r, rec, args, kwargs, outs, device, allow_compile) -> None:
    found = None
    try:
        if allow_compile:
            found = eager.plan_for(r.op, r.info, args, kwargs)
        else:
            found = eager.ready_plan(r.op, r.info, args, kwargs)
    except eager.Compiling:
        found = None
    except NotCompilable as e:
        found = None
        if allow_compile:  # the compiler declined it: a host fallback, as in op mode
            host_fallback.admit(r.info.name, str(e), stacklevel=2)
    if found is not None and type(found[0]) is eager.Plan and found[0].executable is not None:
        plan, sig = found
        eager.launch(plan, sig, device, outs, rec.source())
        stats.op_tier_ops["compiled"] += 1
        op_stats.compiled[r.info.name] += 1
        return
    stats.op_tier_ops["host"] += 1
    queue = device_queue(device.index)
    queue.synchronize()  # device work before this op must have landed
    host_threads.confine()
    aliases: dict = {}
    host_args, host_kwargs = host_fallback.to_host_all(args, kwargs, aliases, r.info.out_args)
    storages = {key: entry[0].untyped_storage().data_ptr() for key, entry in aliases.items()}
    host_args, host_kwargs = numbers_as_tensors(r.op, host_args, host_kwargs)
    watching = trace.sink
    started = time.time_ns() if watching is not None else 0
    try:
        result = r.op(*host_fallback.as_cpu_expects(r.info.name, host_args), **host_kwargs)
    except Exception as e:
        raise NeuronAsyncError(f"neuron: {r.what} (issued at {rec.source()}) failed: {e}") from e
    if watching is not None:
        watching.host("host op", r.info.name, started, time.time_ns(), source=rec.source(),
                      reason="its graph's executable is still compiling")
    host_fallback.sync_mutated(r.info, args, kwargs, host_args, host_kwargs, aliases, storages)
    for j, path in r.outputs:
        transfers.write_into(outs[j], value_at(result, path))


def wait_for_builds(timeout: float | None = None) -> bool:
    """Wait until every fused graph met twice so far is built (or failed); False on timeout."""
    deadline = None if timeout is None else time.monotonic() + timeout
    for fused in list(_fused.values()):
        future = fused.future
        if future is None:
            continue
        try:
            future.result(None if deadline is None else max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            return False
        except Exception:  # noqa: BLE001 - a failed build marks its graph bad
            pass
    return True


def graph_count() -> int:
    return len(_fused)


def reset() -> None:
    _fused.clear()
    _met_once.clear()


recorder.cut_hook = cut
