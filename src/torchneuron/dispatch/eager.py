"""Compile-first eager execution: each op call runs as a cached IREE executable.

signature (cheap, every call) -> plan (lowered once per signature) ->
executable (compiled once per MLIR key, in memory) -> async launch on the
device queue. Results are new device tensors the executable writes in place,
or the arguments it wrote to.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from ..cache import cache_key, executable_cache
from ..compiler import CompileError, compile_mlir, compile_pool, target_flags
from ..lowering import NeedsResize, NotCompilable, lower_call, signature_of
from ..lowering.call import baked_ops
from ..runtime import LoadedExecutable, device_queue, user_source_line
from . import stats


class Plan:
    __slots__ = ("executable", "out_specs", "flag", "returns", "what")

    def __init__(self, executable, out_specs, flag, returns, what):
        self.executable = executable
        self.out_specs = out_specs
        self.flag = flag
        self.returns = returns
        self.what = what


class _ResizeFirst:
    """out= arguments of this signature must be resized before the op runs."""

    __slots__ = ("shapes",)

    def __init__(self, shapes):
        self.shapes = shapes


class _Rejected:
    """A signature the compiler (or lowering) said no to: not retried."""

    __slots__ = ("reason",)

    def __init__(self, reason):
        self.reason = reason


_plans: OrderedDict = OrderedDict()
_plans_lock = threading.Lock()
_MAX_PLANS = 16384


def _build_plan(op, info, sig):
    try:
        lowered = lower_call(op, info, sig)
    except NotCompilable:
        if (sig.floats or sig.ints) and info.name not in baked_ops:
            # The decomposition needs the scalar values: key them as constants.
            baked_ops.add(info.name)
            raise _Retry() from None
        raise
    if lowered.mlir is None:
        return Plan(None, lowered.out_specs, None, lowered.returns, lowered.what)
    backend, flags = target_flags()
    key = cache_key(lowered.mlir, backend, flags)

    def compile_executable():
        vmfb, seconds = compile_mlir(lowered.mlir, lowered.what)
        return LoadedExecutable(vmfb, key, lowered.what), len(vmfb), seconds

    future = executable_cache().get_or_compile(key, compile_executable, compile_pool().submit)
    try:
        executable = future.result()
    except CompileError as e:
        raise NotCompilable(str(e)) from None
    return Plan(executable, lowered.out_specs, lowered.flag, lowered.returns, lowered.what)


class _Retry(Exception):
    pass


def plan_for(op, info, args, kwargs):
    """(plan, signature); raises NotCompilable when this call cannot be compiled."""
    sig = signature_of(op, info, args, kwargs)
    plan = _plans.get(sig.key)
    if plan is None:
        try:
            plan = _build_plan(op, info, sig)
        except _Retry:
            return plan_for(op, info, args, kwargs)
        except NeedsResize as e:
            plan = _ResizeFirst(e.shapes)
        except NotCompilable as e:
            plan = _Rejected(str(e))
        with _plans_lock:
            _plans[sig.key] = plan
            if len(_plans) > _MAX_PLANS:
                _plans.popitem(last=False)
    if type(plan) is _Rejected:
        raise NotCompilable(plan.reason)
    return plan, sig


def run(op, info, args, kwargs, device: torch.device):
    plan, sig = plan_for(op, info, args, kwargs)
    if type(plan) is _ResizeFirst:
        for i, shape in plan.shapes.items():
            sig.tensors[i].resize_(shape)
        plan, sig = plan_for(op, info, args, kwargs)
        if type(plan) is _ResizeFirst:
            raise NotCompilable("out= arguments keep needing a resize")
    if plan.executable is None:  # empty results: nothing to run
        outs = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in plan.out_specs]
        return _assemble(plan.returns, sig.tensors, outs)
    queue = device_queue(device.index)
    views = []
    keepalive = [sig.tensors]
    # One import path for everything (measured: cheaper per launch than
    # DLPack imports, and it grants the write access fills need).
    imp = queue.import_memory
    for t, spec in zip(sig.tensors, sig.specs):
        if spec.stride is None:
            views.append(imp(t, t.storage_offset() * spec.dtype.itemsize, spec.shape, spec.dtype))
        else:
            start = (t.storage_offset() - spec.prefix) * spec.dtype.itemsize
            views.append(imp(t, start, (spec.span,), spec.dtype))
    if sig.floats:
        packed = torch.tensor(sig.floats, dtype=torch.float64)
        keepalive.append(packed)
        views.append(imp(packed, 0, (len(sig.floats),), torch.float64))
    if sig.ints:
        packed = torch.tensor(sig.ints, dtype=torch.int64)
        keepalive.append(packed)
        views.append(imp(packed, 0, (len(sig.ints),), torch.int64))
    outs = []
    for shape, dtype in plan.out_specs:
        out = torch.empty(shape, dtype=dtype, device=device)
        outs.append(out)
        views.append(imp(out, 0, shape, dtype))
    keepalive.append(outs)
    flag = outs[plan.flag] if plan.flag is not None else None
    queue.launch(plan.executable, views, keepalive, plan.what, user_source_line(), flag)
    stats.record(stats.compiled, info.name)
    return _assemble(plan.returns, sig.tensors, outs)


def _assemble(template, tensors, outs):
    if template is None:
        return None
    kind = template[0]
    if kind == "out":
        return outs[template[1]]
    if kind == "arg":
        return tensors[template[1]]
    items = [_assemble(t, tensors, outs) for t in template[1]]
    return items if kind == "list" else tuple(items)


def plan_count() -> int:
    return len(_plans)


def reset() -> None:
    with _plans_lock:
        _plans.clear()
