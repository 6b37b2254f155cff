"""Compile-first eager execution: each op call runs as a cached IREE executable.

signature (cheap, every call) -> plan (lowered once per signature) ->
executable (compiled once per MLIR key, in memory) -> async launch on the
device queue. Results are new device tensors the executable writes in place,
or the arguments it wrote to.

Never stall: a signature no cache layer has a plan for is built in the
background (lowered in the lowering worker process, compiled at low
priority), and until it lands its calls raise Compiling, which the entry
point answers with the host path (PyTorch's kernels on the same memory).
TORCHNEURON_COMPILE_WAIT=1, or the fallback policy "error" (which must know
the verdict before the op runs), builds in line instead.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections import OrderedDict

import torch

from .. import config
from ..cache.disk import disk_cache
from ..cache.executables import executable_for
from ..cache.key import plan_id
from ..compiler import compile_pool, says_nothing_about_the_module, target_flags, target_known
from ..compiler.pool import background_pool, default_workers
from ..lowering import NeedsResize, NotCompilable, lower_call, signature_of
from ..lowering.graph import promotable_scalars
from ..lowering.call import FRef, IRef, Seq, baked_ops
from ..lowering.carriers import carrier_dtypes
from ..lowering.worker import lower_call_elsewhere
from ..runtime import device_queue, synchronize_all
from . import cached_launch, host_fallback, stats, warm_start
from .cached_launch import assemble, new_output
from .op_info import op_info
from .plans import Bake, Plan, Rejected, plan_from_record, record_of


class _ResizeFirst:
    """out= arguments of this signature must be resized before the op runs."""

    __slots__ = ("shapes",)

    def __init__(self, shapes):
        self.shapes = shapes


class Compiling(Exception):
    """This call's executable is still being built in the background: run it
    another way now (the host path)."""


class _Building:
    """A signature whose plan is being built in the background."""

    __slots__ = ("future",)

    def __init__(self, future):
        self.future = future


_plans: OrderedDict = OrderedDict()
_plans_lock = threading.Lock()
_MAX_PLANS = 16384


def _build_plan(op, info, sig, target, lower):
    try:
        return _compile_plan(op, info, sig, target, lower, promote_scalars=False)
    except NotCompilable as e:
        if not promotable_scalars(sig):
            raise
        first = e
    # All-0-dim calls the compiler rejects (reductions, some elementwise ops)
    # compile as 1-element calls.
    try:
        return _compile_plan(op, info, sig, target, lower, promote_scalars=True)
    except NotCompilable:
        raise first from None


def _compile_plan(op, info, sig, target, lower, promote_scalars):
    try:
        lowered = lower(op, info, sig, promote_scalars)
    except NotCompilable:
        if (sig.floats or sig.ints) and info.name not in baked_ops:
            # The decomposition needs the scalar values: key them as constants.
            baked_ops.add(info.name)
            raise _Retry() from None
        raise
    if lowered.mlir is None:
        return Plan(None, lowered.out_specs, None, lowered.returns, lowered.what)
    # In the background the compile runs in the builder's (low priority) thread.
    submit = None if lower is lower_call_elsewhere else compile_pool().submit
    executable = executable_for(lowered.mlir, lowered.what, target, submit)
    return Plan(executable, lowered.out_specs, lowered.flag, lowered.returns, lowered.what, lowered.write_back)


class _Retry(Exception):
    pass


def _plan_of(record, info, disk):
    plan = plan_from_record(record, disk)
    if type(plan) is Bake:
        baked_ops.add(info.name)
        raise _Retry()
    return plan


def _new_plan(op, info, sig):
    """The plan a cache layer has for this signature, else one built here
    (compile_wait) or a _Building whose plan lands later."""
    in_line = _builds_in_line()
    if not in_line and not target_known():
        # A cold process's CPU is still being resolved: even the cache
        # lookup needs it, so the lookup goes to the background too.
        stats.add_build("background")
        detached = dataclasses.replace(sig, tensors=[])
        return _Building(_builder().submit(_plan_in_background, op, info, detached))
    target = target_flags()
    disk = disk_cache()
    pid = plan_id(sig.key, *target) if disk is not None else None
    plan = _stored_plan(info, disk, pid, preloaded=True)
    if plan is not None:
        return plan
    if in_line:
        started = time.perf_counter()
        try:
            return _build_or_read(op, info, sig, target, disk, pid, lower_call)
        finally:
            stats.add_build("in_line", time.perf_counter() - started)
    detached = dataclasses.replace(sig, tensors=[])  # the build must not keep the caller's tensors
    stats.add_build("background")
    return _Building(_builder().submit(_build_in_background, op, info, detached, target, disk, pid))


def _stored_plan(info, disk, pid, preloaded=False):
    if pid is None:
        return None
    warm_start.record(pid)
    plan = warm_start.take(pid) if preloaded else None
    if type(plan) is Bake:
        plan = None
    return plan if plan is not None else _plan_of(disk.get_plan(pid), info, disk)


def _plan_in_background(op, info, sig):
    target = target_flags()
    disk = disk_cache()
    pid = plan_id(sig.key, *target) if disk is not None else None
    plan = _stored_plan(info, disk, pid)
    return plan if plan is not None else _build_in_background(op, info, sig, target, disk, pid)


def _builds_in_line() -> bool:
    settings = config.settings
    return settings.compile_wait or settings.fallback == "error"


def _build_in_background(op, info, sig, target, disk, pid):
    try:
        plan = _build_or_read(op, info, sig, target, disk, pid, lower_call_elsewhere)
        if type(plan) is Rejected:
            # Reported now, not when the op is next called: a program that
            # never calls it again still sees it in compile_stats().
            stats.fallback_reasons.setdefault(info.name, plan.reason)
        return plan
    except _Retry:
        # The op needs its scalars as constants: build that signature now
        # too, so a program that exits before calling the op again still
        # leaves it in the cache (a restart then compiles nothing).
        baked = _with_scalars_baked(sig)
        baked_pid = plan_id(baked.key, *target) if disk is not None else None
        plan = _build_or_read(op, info, baked, target, disk, baked_pid, lower_call_elsewhere)
        with _plans_lock:
            _plans.setdefault(baked.key, plan)
        if baked_pid is not None:
            warm_start.record(baked_pid)
        raise


def _with_scalars_baked(sig):
    """The signature signature_of gives the same call once its op is in
    baked_ops: runtime scalars become constants."""
    def bake(s):
        if isinstance(s, FRef):
            return ("float", sig.floats[s.j])
        if isinstance(s, IRef):
            return sig.ints[s.j]
        if isinstance(s, Seq):
            return Seq(s.kind, tuple(bake(x) for x in s.items))
        return s

    args = tuple(bake(s) for s in sig.args)
    kwargs = tuple((k, bake(s)) for k, s in sig.kwargs)
    return dataclasses.replace(sig, key=(sig.key[0], args, kwargs, sig.specs), args=args, kwargs=kwargs,
                               floats=[], ints=[])


def _build_or_read(op, info, sig, target, disk, pid, lower):
    if pid is None:
        return _build_or_reject(op, info, sig, target, lower)
    # One process per signature per host lowers it; the others wait and read.
    with disk.lock("plan-" + pid):
        plan = _plan_of(disk.get_plan(pid), info, disk)
        if plan is None:
            try:
                plan = _build_or_reject(op, info, sig, target, lower)
            except _Retry:
                disk.put_plan(pid, {"kind": "bake"})
                raise
            if _deterministic(plan):
                disk.put_plan(pid, record_of(plan, op))
    return plan


_op_builder = None
_op_builder_lock = threading.Lock()


def _builder():
    global _op_builder
    with _op_builder_lock:
        if _op_builder is None:
            # One thread lowers (the worker takes one request at a time) while
            # the others compile what it lowered.
            _op_builder = background_pool("neuron-op-build", default_workers())
        return _op_builder


def _landed(key, building):
    """The plan a background build produced (stored in place of `building`);
    raises Compiling while it runs; None: build again (scalars now baked)."""
    future = building.future
    if not future.done():
        raise Compiling()
    try:
        plan = future.result()
    except NeedsResize as e:
        plan = _ResizeFirst(e.shapes)
    except _Retry:
        plan = None
    except Exception as e:  # noqa: BLE001 - a build that broke: the op is not compiled
        plan = Rejected(f"the background build failed: {type(e).__name__}: {e}"[:500])
    with _plans_lock:
        if plan is None:
            _plans.pop(key, None)
        else:
            _plans[key] = plan
    return plan


def builds_in_flight() -> int:
    """Background op builds started and not landed yet."""
    with _plans_lock:
        return sum(1 for p in _plans.values() if type(p) is _Building and not p.future.done())


def wait_for_builds(timeout: float | None = None) -> bool:
    """Wait until every background op build started so far has landed; False on timeout."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with _plans_lock:
        pending = [p.future for p in _plans.values() if type(p) is _Building]
    for future in pending:
        try:
            future.result(None if deadline is None else max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            return False
        except Exception:  # noqa: BLE001 - a failed build is landed too
            pass
    return True


def _deterministic(plan) -> bool:
    """Whether a verdict holds for every process: a compiler that crashed
    (killed, out of memory or disk) or was stopped by a limit says nothing
    about the op."""
    return type(plan) is not Rejected or not says_nothing_about_the_module(plan.reason)


def _build_or_reject(op, info, sig, target, lower):
    try:
        return _build_plan(op, info, sig, target, lower)
    except NeedsResize:
        raise
    except NotCompilable as e:
        return Rejected(str(e))


def plan_for(op, info, args, kwargs):
    """(plan, signature); raises NotCompilable when this call cannot be
    compiled, Compiling while its plan is built in the background."""
    sig = signature_of(op, info, args, kwargs)
    plan = _plans.get(sig.key)
    if type(plan) is _Building:
        plan = _landed(sig.key, plan)
        if plan is None:
            return plan_for(op, info, args, kwargs)
    if plan is None:
        try:
            plan = _new_plan(op, info, sig)
        except _Retry:
            return plan_for(op, info, args, kwargs)
        except NeedsResize as e:
            plan = _ResizeFirst(e.shapes)
        with _plans_lock:
            _plans[sig.key] = plan
            if len(_plans) > _MAX_PLANS:
                _plans.popitem(last=False)
    if type(plan) is Rejected:
        raise NotCompilable(plan.reason)
    if type(plan) is _Building:
        raise Compiling()
    return plan, sig


def run(op, info, args, kwargs, device: torch.device, remember: bool = False):
    """Run one call compiled; `remember`: let later calls with the same cheap
    key skip the signature (cached_launch)."""
    plan, sig = plan_for(op, info, args, kwargs)
    if type(plan) is _ResizeFirst:
        for i, shape in plan.shapes.items():
            sig.tensors[i].resize_(shape)
        plan, sig = plan_for(op, info, args, kwargs)
        if type(plan) is _ResizeFirst:
            raise NotCompilable("out= arguments keep needing a resize")
    if plan.executable is None:  # empty results: nothing to run
        outs = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in plan.out_specs]
        return assemble(plan.returns, sig.tensors, outs)
    outs = launch(plan, sig, device)
    stats.record(stats.compiled, info.name)
    if remember:
        cached_launch.remember(op, info, args, kwargs, sig, plan, device, write_back)
    return assemble(plan.returns, sig.tensors, outs)


def ready_plan(op, info, args, kwargs):
    """(plan, signature) when this call's executable is loaded in memory,
    else None: nothing is lowered or compiled (adaptive eager's op tier)."""
    try:
        sig = signature_of(op, info, args, kwargs)
    except NotCompilable:
        return None
    plan = _plans.get(sig.key)
    if type(plan) is not Plan or plan.executable is None:
        return None
    return plan, sig


def launch(plan, sig, device, outs=None, source=None) -> list:
    """Queue `plan` on the call's tensors; its new results are `outs` when
    given (tensors of plan.out_specs, the index flag excepted), else
    allocated here. Returns the outputs, flag included. `source`: the line
    that issued the call, when it is not on the stack (adaptive replays)."""
    queue = device_queue(device.index)
    if plan.largest is None:
        plan.largest = largest_tensor(sig.specs, plan.out_specs)
        plan.carriers = carrier_dtypes(sig.specs, sig.mutated - {i for _, i in plan.write_back})
    lane = queue.lane_for(plan.largest)
    views = []
    keepalive = [sig.tensors]
    # One import path for everything (measured: cheaper per launch than
    # DLPack imports, and it grants the write access fills need).
    imp = lane.import_memory
    carriers = plan.carriers
    for i, (t, spec) in enumerate(zip(sig.tensors, sig.specs)):
        dtype = carriers.get(i, spec.dtype) if carriers else spec.dtype
        if spec.stride is None:
            views.append(imp(t, t.storage_offset() * dtype.itemsize, spec.shape, dtype))
        else:
            start = (t.storage_offset() - spec.prefix) * dtype.itemsize
            views.append(imp(t, start, (spec.span,), dtype))
    index = device.index
    if sig.floats:
        packed, view = lane.import_numbers(sig.floats, torch.float64, index)
        keepalive.append(packed)
        views.append(view)
    if sig.ints:
        packed, view = lane.import_numbers(sig.ints, torch.int64, index)
        keepalive.append(packed)
        views.append(view)
    given = iter(outs or ())
    outs = []
    for j, (shape, dtype) in enumerate(plan.out_specs):
        out = next(given, None) if j != plan.flag else None
        if out is None:
            out = new_output(shape, dtype, index)
        outs.append(out)
        views.append(imp(out, out.storage_offset() * dtype.itemsize, shape, dtype))
    keepalive.append(outs)
    flag = outs[plan.flag] if plan.flag is not None else None
    queue.launch(plan.executable, views, keepalive, plan.what, flag, lane, source)
    if plan.write_back:
        write_back(plan, sig.tensors, outs)
    return outs


def write_back(plan, tensors, outs) -> None:
    """Copy the new values of inputs the executable could not overwrite in
    place into them: a second launch, queued after the first. It goes straight
    to the op path: adaptive eager's replays call this, and must not record."""
    copy = torch.ops.aten.copy_.default
    for j, i in plan.write_back:
        dst, src = tensors[i], outs[j]
        try:
            run(copy, op_info(copy), (dst, src), {}, dst.device, remember=True)
        except (Compiling, NotCompilable):
            synchronize_all()
            host_fallback.run(copy, op_info(copy), (dst, src), {}, dst.device)


def largest_tensor(specs, out_specs) -> int:
    """Elements of the largest tensor a launch reads (its span when strided) or writes."""
    sizes = [spec.span if spec.stride is not None else math.prod(spec.shape) for spec in specs]
    sizes += [math.prod(shape) for shape, _ in out_specs]
    return max(sizes, default=0)


def plan_count() -> int:
    return len(_plans)


def reset() -> None:
    with _plans_lock:
        _plans.clear()
        cached_launch.reset()


def _on_setting(name, value) -> None:
    # Plans in memory hold executables compiled for the old target: forget them.
    if name in ("target_cpu", "driver"):
        reset()


config.on_change(_on_setting)
