"""Cutting a pending graph and running it: never stall on a compile.

At the cut, the new storages nobody but the graph holds are dead
intermediates: they are left out of the fused executable's results. The
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

import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .. import _C, config
from ..cache import cache_key, executable_cache, layers
from ..cache.disk import disk_cache
from ..cache.key import plan_id
from ..compiler import target_flags
from ..dispatch import eager, host_fallback
from ..dispatch import stats as op_stats
from ..lowering import NotCompilable
from ..lowering.call import numbers_as_tensors, rebuild
from ..lowering.fused import GraphOp, GraphSpec, SlotSpec, ViewRef
from ..lowering.worker import lower_graph_elsewhere
from ..lowering.graph import _get
from ..runtime import LoadedExecutable, device_queue
from ..runtime.errors import NeuronAsyncError
from . import recorder, stats

_use_count = torch._C._storage_Use_Count
_READY, _BUILDING, _BAD = "ready", "building", "bad"


class FusedGraph:
    __slots__ = ("state", "executable", "reason", "future", "what", "largest", "n_ops")

    def __init__(self, n_ops):
        self.state = _BUILDING
        self.executable = None
        self.reason = ""
        self.future = None
        self.what = ""
        self.largest = 0
        self.n_ops = n_ops


_fused: OrderedDict = OrderedDict()  # identity -> FusedGraph
_MAX_FUSED = 4096
_builder = None
_builder_lock = threading.Lock()


def _build_pool() -> ThreadPoolExecutor:
    """One background thread builds fused graphs: it has them lowered in the
    worker process (lowering.worker) and compiles them, at a lower scheduling
    priority than the program (compiles it starts inherit it)."""
    global _builder
    with _builder_lock:
        if _builder is None:
            _builder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="neuron-adaptive-build",
                                          initializer=_lower_priority)
            # At exit, builds not started are dropped (the one running finishes
            # and lands in the cache for the next run).
            threading._register_atexit(_builder.shutdown, wait=False, cancel_futures=True)
        return _builder


def _lower_priority() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (OSError, AttributeError):
        pass


def cut(graph, reason: str) -> None:
    """Run a detached pending graph (see the module docstring)."""
    stats.cut_reasons[reason] += 1
    n = len(graph.ops)
    stats.add("graphs_cut", 1)
    stats.add("ops_recorded", n)
    if n > stats.largest_graph:
        stats.largest_graph = n
    storages = graph.storages
    live = tuple(
        i for i, external in enumerate(graph.external) if not external and _use_count(storages[i]._cdata) > 1
    )
    identity = (tuple(graph.identity), live)
    fused = _fused.get(identity)
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
        _launch_fused(graph, fused, live)
    else:
        _replay(graph, allow_compile=fused.state is _BAD)


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


def _launch_fused(graph, fused, live) -> None:
    index = graph.index
    queue = device_queue(index)
    lane = queue.lane_for(fused.largest)
    imp = lane.import_at
    addresses, dtypes, numels = graph.addresses, graph.dtypes, graph.numels
    bound = [imp(addresses[i], (numels[i],), dtypes[i]) for i, ext in enumerate(graph.external) if ext]
    keepalive = [graph.storages]
    if graph.floats:
        packed = torch.tensor(graph.floats, dtype=torch.float64)
        keepalive.append(packed)
        bound.append(lane.import_memory(packed, 0, (len(graph.floats),), torch.float64))
    if graph.ints:
        packed = torch.tensor(graph.ints, dtype=torch.int64)
        keepalive.append(packed)
        bound.append(lane.import_memory(packed, 0, (len(graph.ints),), torch.int64))
    for i in live:
        bound.append(imp(addresses[i], (numels[i],), dtypes[i]))
    checked = [op for op in graph.ops if op.recipe.checked]
    flag = None
    what = fused.what
    if checked:
        flag = new_flags = _C.empty((len(checked),), torch.bool, index)
        keepalive.append(new_flags)
        bound.append(lane.import_memory(new_flags, 0, (len(checked),), torch.bool))
        what = _FusedWhat(fused.what, [(op.recipe.what, op.source()) for op in checked])
    queue.launch(fused.executable, bound, keepalive, what, flag, lane)
    stats.launches["fused"] += 1
    stats.add("ops_fused", len(graph.ops))
    compiled = op_stats.compiled
    for op in graph.ops:
        compiled[op.recipe.info.name] += 1
    dead = sum(numels[i] * dtypes[i].itemsize for i, ext in enumerate(graph.external) if not ext and i not in live)
    if dead:
        stats.add("bytes_not_written", dead)


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


def _describe(graph) -> str:
    names = [op.recipe.info.name.replace("aten.", "") for op in graph.ops]
    shown = ", ".join(names[:6]) + (f", ... ({len(names)} ops)" if len(names) > 6 else "")
    first = graph.ops[0].source()
    return f"fused graph [{shown}] from {first}"


def _submit_build(fused, graph, live) -> None:
    spec = spec_of(graph, live)
    floats, ints = list(graph.floats), list(graph.ints)
    fused.what = _describe(graph)
    sizes = [n for n, e in zip(graph.numels, graph.external) if e] + [graph.numels[i] for i in live]
    fused.largest = max(sizes, default=0)
    stable = (tuple((op.recipe.key, op.refs) for op in graph.ops), tuple(graph.identity), live)
    future: Future = _build_pool().submit(_build, fused, spec, floats, ints, stable)
    fused.future = future


def _build(fused, spec, floats, ints, stable) -> None:
    started = time.perf_counter()
    target = target_flags()
    disk = disk_cache()
    pid = plan_id(stable, *target) if disk is not None else None
    try:
        record = disk.get_plan(pid) if pid is not None else None
        if record is not None and record.get("kind") == "bad-graph":
            raise NotCompilable(str(record.get("reason", "marked bad by another process")))
        key = record.get("executable") if record is not None and record.get("kind") == "graph" else None
        executable = executable_cache().get(key) if key else None
        if executable is None and key:
            vmfb = disk.get_executable(key)
            if vmfb is not None:
                executable, _ = executable_cache().put(key, LoadedExecutable(vmfb, key, fused.what), len(vmfb))
                layers.stats.add("disk")
        if executable is None:
            mlir = lower_graph_elsewhere(spec, floats, ints)
            key = cache_key(mlir, *target)

            def compile_executable():
                vmfb, seconds, source = layers.fetch_or_compile(key, mlir, fused.what, target)
                return LoadedExecutable(vmfb, key, fused.what), len(vmfb), seconds, source

            executable = executable_cache().get_or_compile(key, compile_executable, lambda fn: fn()).result()
            if pid is not None:
                disk.put_plan(pid, {"kind": "graph", "executable": key})
        fused.executable = executable
        fused.state = _READY
        stats.add("graphs_compiled", 1)
    except Exception as e:  # noqa: BLE001 - any failure: the ops run one by one
        fused.reason = f"{type(e).__name__}: {str(e)[:500]}"
        fused.state = _BAD
        stats.add("graphs_failed", 1)
        if pid is not None and "Error code: -" not in fused.reason:  # a crashed compiler says nothing
            disk.put_plan(pid, {"kind": "bad-graph", "reason": fused.reason})
    finally:
        stats.add("compile_seconds_hidden", time.perf_counter() - started)


# -- one op at a time -----------------------------------------------------------

def _replay(graph, allow_compile: bool) -> None:
    """Run a graph's ops one by one, into the tensors recording handed out."""
    stats.launches["op"] += 1
    device = torch.device("neuron", graph.index)
    bases: dict = {}

    def base(slot):
        b = bases.get(slot)
        if b is None:
            b = bases[slot] = torch.empty(0, dtype=graph.dtypes[slot], device=device).set_(graph.storages[slot])
        return b

    for rec in graph.ops:
        r = rec.recipe
        refs = rec.refs
        tensors = [
            base(refs[2 * k]).as_strided(shape, stride, refs[2 * k + 1]) for k, (shape, stride) in enumerate(r.views)
        ]
        outs = [base(slot).view(shape) for slot, (shape, _) in zip(rec.out_slots, r.out_specs)]
        args = tuple(rebuild(s, tensors, rec.floats, rec.ints, device) for s in r.args)
        kwargs = {k: rebuild(s, tensors, rec.floats, rec.ints, device) for k, s in r.kwargs}
        _run_one(r, rec, args, kwargs, outs, device, allow_compile)


def _run_one(r, rec, args, kwargs, outs, device, allow_compile) -> None:
    found = None
    try:
        if allow_compile:
            found = eager.plan_for(r.op, r.info, args, kwargs)
        else:
            found = eager.ready_plan(r.op, r.info, args, kwargs)
    except NotCompilable:
        found = None
    if found is not None and type(found[0]) is eager.Plan and found[0].executable is not None:
        plan, sig = found
        eager.launch(plan, sig, device, outs)
        stats.op_tier_ops["compiled"] += 1
        op_stats.compiled[r.info.name] += 1
        return
    stats.op_tier_ops["host"] += 1
    queue = device_queue(device.index)
    queue.synchronize()  # device work before this op must have landed
    aliases: dict = {}
    host_args = host_fallback._to_host(args, aliases)
    host_kwargs = {k: host_fallback._to_host(v, aliases) for k, v in kwargs.items()}
    host_args, host_kwargs = numbers_as_tensors(r.op, host_args, host_kwargs)
    try:
        result = r.op(*host_args, **host_kwargs)
    except Exception as e:
        raise NeuronAsyncError(f"neuron: {r.what} (issued at {rec.source()}) failed: {e}") from e
    for j, path in r.outputs:
        _C.host_alias(outs[j]).copy_(_get(result, path))


def wait_for_builds(timeout: float | None = None) -> bool:
    """Wait until every fused graph met so far is built (or failed); False on timeout."""
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


recorder.cut_hook = cut
