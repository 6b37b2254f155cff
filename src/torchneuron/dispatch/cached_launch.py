"""The hot path of compile-first eager: a call whose plan is known launches
without building its full signature.

A plan is remembered under a cheap key (the op, and per argument its
tensor's shape, dtype and device, a number's kind, or a constant's value) once
the full path has compiled it and checked that this key takes the call apart
exactly as the full signature does. Calls with host tensors, views the op
writes, or arguments of other types take the full path. A tiny op costs about a third of what the full path costs
(docs/benchmarks.md).
"""

from __future__ import annotations

import torch

from ..lowering.call import ALIGNMENT, NotCompilable, baked_ops, param_arg_names, tensor_spec
from ..runtime import device_queue
from .. import _C
from . import stats

MISS = object()
_Tensor = torch.Tensor
_FLOAT, _INT = "float", "int"  # a runtime number's place in a key

_launches: dict = {}  # cheap key -> _Launch
_MAX_LAUNCHES = 16384
_params: dict = {}  # op -> (per position, by name): is a number there a runtime input
hits = 0  # calls launched here (compile_stats()["cached_launches"])


class _Launch:
    # writes: indices of tensors the op writes; write_back: the op path's
    # copy into inputs the executable could not overwrite, or None
    __slots__ = ("plan", "index", "queue", "writes", "name", "write_back")

    def __init__(self, plan, device, writes, name, write_back):
        self.plan = plan
        self.index = device.index
        self.queue = device_queue(device.index)
        self.writes = writes
        self.name = name
        self.write_back = write_back if plan.write_back else None


def _params_of(op, info):
    params = _params.get(op)
    if params is None:
        names = frozenset() if info.name in baked_ops else param_arg_names(op)
        params = _params[op] = (tuple(n in names for n in info.arg_names), names)
    return params


def call_key(op, args, kwargs, params):
    """(key, tensors, spans, floats, ints), or None when the call needs the
    full path. spans[i]: None for a tensor passed directly, else its
    TensorSpec (a strided view, passed as the span of storage around it)."""
    key = [op]
    tensors = []
    spans = []
    numbers = ([], [])  # runtime floats, ints
    positional, names = params
    for i, a in enumerate(args):
        if not _leaf(a, i < len(positional) and positional[i], key, tensors, spans, numbers):
            return None
    for name, a in kwargs.items():
        key.append(name)
        if not _leaf(a, name in names, key, tensors, spans, numbers):
            return None
    return tuple(key), tensors, spans, numbers[0], numbers[1]


_CONSTANT_TYPES = (str, torch.dtype, torch.layout, torch.memory_format)


def _leaf(a, param, key, tensors, spans, numbers) -> bool:
    """Add one argument to the key; False when the full path must take it."""
    if isinstance(a, _Tensor):
        tensors.append(a)
        key.append(a.device)
        if a.is_contiguous() and not a.data_ptr() % ALIGNMENT:
            spans.append(None)
            key.append(a.shape)
            key.append(a.dtype)
            return True
        try:
            spec = tensor_spec(a)
        except NotCompilable:
            return False
        spans.append(spec)
        key.append(spec)
        return True
    t = type(a)
    if t is float or t is int:
        if param:
            numbers[t is int].append(a)
            key.append(_INT if t is int else _FLOAT)
        else:
            key.append(t)
            key.append(a)
        return True
    if a is None or t is bool:
        key.append(a)
        return True
    if t is list or t is tuple:
        key.append(t)
        key.append(len(a))
        return all(_leaf(x, param, key, tensors, spans, numbers) for x in a)
    if isinstance(a, _CONSTANT_TYPES):
        key.append(a)
        return True
    if t is torch.device and a.index is not None:  # no index: the current device, which may change
        key.append(a)
        return True
    return False


def remember(op, info, args, kwargs, sig, plan, device, write_back) -> None:
    """Called after the full path launched `plan` for this call: remember it
    under the cheap key if that key takes the call apart the same way.
    `write_back(plan, tensors, outs)`: the full path's copy of results into
    inputs (eager.py), run after each launch of a plan that has one."""
    if plan.executable is None or any(spec.on_host for spec in sig.specs):
        return
    if sig.mutated and any(spec.stride is not None for spec in sig.specs):
        return  # a written view may overlap itself: the full path checks each call
    _params.pop(op, None)  # which numbers are runtime inputs changes when an op is baked
    found = call_key(op, args, kwargs, _params_of(op, info))
    if found is None:
        return
    key, tensors, _, floats, ints = found
    if (
        len(tensors) != len(sig.tensors)
        or any(a is not b for a, b in zip(tensors, sig.tensors))
        or floats != sig.floats
        or ints != sig.ints
    ):
        return
    if len(_launches) >= _MAX_LAUNCHES:
        del _launches[next(iter(_launches))]
    _launches[key] = _Launch(plan, device, tuple(sorted(sig.mutated)), info.name, write_back)


def run(op, args, kwargs):
    """The call's results if its plan is remembered, else MISS."""
    params = _params.get(op)
    if params is None:
        return MISS
    found = call_key(op, args, kwargs, params)
    if found is None:
        return MISS
    key, tensors, spans, floats, ints = found
    launch = _launches.get(key)
    if launch is None:
        return MISS
    # From now on the C++ entry hands calls like this one to _launch_known
    # directly (the spans are the same for every call it keys alike).
    _C.learn_call(_launch_known, (launch, spans), launch.name, sorted(params[1]), tensors, floats, ints)
    return _launch(launch, tensors, spans, floats, ints)


def _launch_known(known, tensors, floats, ints):
    """Called by the C++ entry (csrc/recording.cpp) for a call learned above
    (it checks what dispatch.entry.fast_path_open checks first)."""
    return _launch(known[0], tensors, known[1], floats, ints)


def _launch(launch, tensors, spans, floats, ints):
    if launch.writes and _writes_shared_memory(tensors, launch.writes):
        return MISS  # the full path says why it cannot compile this
    plan = launch.plan
    queue = launch.queue
    lane = queue.lane_for(plan.largest)
    views = lane.views
    imp = lane.import_memory
    bound = []
    carriers = plan.carriers
    for i, (t, span) in enumerate(zip(tensors, spans)):
        dtype = carriers.get(i, t.dtype) if carriers else t.dtype
        if span is None:
            shape = t.shape
            view = views.get((t.data_ptr(), shape, dtype))
            bound.append(view if view is not None else imp(t, t.storage_offset() * dtype.itemsize, shape, dtype))
        else:
            bound.append(imp(t, (t.storage_offset() - span.prefix) * dtype.itemsize, (span.span,), dtype))
    keepalive = [tensors]
    index = launch.index
    if floats:
        packed, view = lane.import_numbers(floats, torch.float64, index)
        keepalive.append(packed)
        bound.append(view)
    if ints:
        packed, view = lane.import_numbers(ints, torch.int64, index)
        keepalive.append(packed)
        bound.append(view)
    outs = []
    for shape, dtype in plan.out_specs:
        out = new_output(shape, dtype, index)
        outs.append(out)
        view = views.get((out.data_ptr(), shape, dtype))
        bound.append(view if view is not None else imp(out, 0, shape, dtype))
    keepalive.append(outs)
    flag = outs[plan.flag] if plan.flag is not None else None
    queue.launch(plan.executable, bound, keepalive, plan.what, flag, lane)
    if launch.write_back is not None:
        launch.write_back(plan, tensors, outs)
    stats.dispatched[launch.name] += 1
    stats.compiled[launch.name] += 1
    global hits
    hits += 1
    returns = plan.returns
    if returns is not None:
        kind = returns[0]
        if kind == "out":
            return outs[returns[1]]
        if kind == "arg":
            return tensors[returns[1]]
    return assemble(returns, tensors, outs)


new_output = _C.empty  # (shape, dtype, device index): a contiguous device tensor


def assemble(template, tensors, outs):
    """An op's results from its plan's template: new outputs and written arguments."""
    if template is None:
        return None
    kind = template[0]
    if kind == "out":
        return outs[template[1]]
    if kind == "arg":
        return tensors[template[1]]
    items = [assemble(t, tensors, outs) for t in template[1]]
    return items if kind == "list" else tuple(items)


def _writes_shared_memory(tensors, writes) -> bool:
    """An argument the op writes shares memory with another argument."""
    storages = [t.untyped_storage().data_ptr() for t in tensors]
    return any(storages.count(storages[i]) > 1 for i in writes)


def count() -> int:
    return len(_launches)


def reset() -> None:
    _C.forget_calls(None)
    _launches.clear()
    _params.clear()
