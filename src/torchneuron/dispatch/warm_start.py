"""Warm start: a restarted program finds its op plans loaded before it needs them.

Each program (by its script path) keeps a manifest in the disk cache of the
plans it used, in first-use order. The next run of that program starts a
background thread at its first neuron op (typically `model.to("neuron")`) that
reads those plans and their executables from disk and loads them onto the
device while the program is still setting up, so its first step finds them
in memory instead of on disk.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import sys
import threading

_MAX_MANIFEST = 4096

_used: list = []  # plan ids this process planned, in first-use order
_seen: set = set()
_preloaded: dict = {}  # plan id -> plan, loaded ahead of need
_lock = threading.Lock()
_started = False
_atexit_registered = False


def _manifest_name() -> str:
    from ..compiler import target_flags

    program = os.path.realpath(sys.argv[0]) if sys.argv and sys.argv[0] not in ("", "-c", "-m") else "interactive"
    # One manifest per target too: a run compiling for another CPU (on a
    # shared cache directory) must not preload executables built for this one.
    backend, flags = target_flags()
    return hashlib.sha256("\0".join((program, backend, *flags)).encode()).hexdigest()[:32]


def record(plan_id: str) -> None:
    """Note that this process uses plan_id (once per plan, not per call)."""
    global _atexit_registered
    if plan_id in _seen:
        return
    _seen.add(plan_id)
    _used.append(plan_id)
    if not _atexit_registered:
        _atexit_registered = True
        atexit.register(save)


def save() -> None:
    from ..cache.disk import disk_cache

    try:
        disk = disk_cache()
    except Exception:  # noqa: BLE001 - nothing to report to at exit
        return
    if disk is None or not disk.writable or not _used:
        return
    try:
        name = _manifest_name()
    except Exception:  # noqa: BLE001 - no target (e.g. a refused TORCHNEURON_TARGET_CPU): nothing to save
        return
    previous = _read(disk, name)
    ids = list(_used) + [p for p in previous if p not in _seen]
    disk.write_record("warm", name, json.dumps(ids[:_MAX_MANIFEST]).encode())


def _read(disk, name: str) -> list:
    try:
        ids = json.loads(disk.read_record("warm", name) or b"[]")
    except ValueError:
        return []
    return [p for p in ids if isinstance(p, str)] if isinstance(ids, list) else []


def begin(device_index: int) -> None:
    """Start preloading this program's plans (once per process)."""
    global _started
    if _started:
        return
    _started = True
    from ..cache.disk import disk_cache

    try:
        disk = disk_cache()
    except Exception:  # noqa: BLE001 - the first op reports a bad cache directory
        return
    if disk is None:
        return
    from ..compiler import target_known

    # With a cold cache the CPU is still being resolved (there is nothing
    # to preload then either); the manifest is read on a thread regardless,
    # so the first op never waits for it.
    try:
        target_known()
    except Exception:  # noqa: BLE001 - the first op reports a target it cannot use
        return
    threading.Thread(target=_preload, args=(disk, device_index), name="neuron-warm-start", daemon=True).start()


def _preload(disk, device_index: int) -> None:
    from ..cache.key import code_fingerprint
    from ..runtime import device_queue
    from .plans import plan_from_record

    try:
        ids = _read(disk, _manifest_name())
        if not ids:
            return
        code_fingerprint()  # hashes the sources once: off the first step's path
        queue = device_queue(device_index)
        for pid in ids:
            record = disk.get_plan(pid)
            plan = plan_from_record(record, disk)
            if plan is None:
                continue
            _describe_op(record.get("op"))
            if getattr(plan, "executable", None) is not None:
                # Its launches' lane depends on their shapes: load it on both.
                for lane in (queue.task, queue.inline):
                    if lane is not None:
                        plan.executable.entry(lane)
            with _lock:
                _preloaded[pid] = plan
    except Exception:  # noqa: BLE001 - an optimization: the program loads on demand instead
        return


def _describe_op(name) -> None:
    """Fill the per-op tables the first call of an op would otherwise build."""
    import torch

    from ..lowering.call import param_arg_names
    from .op_info import op_info

    if not isinstance(name, str) or "::" not in name:
        return
    ns, _, qualified = name.partition("::")
    opname, _, overload = qualified.partition(".")
    try:
        op = getattr(getattr(getattr(torch.ops, ns), opname), overload or "default")
    except (AttributeError, RuntimeError):
        return
    op_info(op)
    param_arg_names(op)


def take(plan_id: str):
    """The preloaded plan for plan_id, or None."""
    if not _preloaded:
        return None
    with _lock:
        return _preloaded.pop(plan_id, None)
