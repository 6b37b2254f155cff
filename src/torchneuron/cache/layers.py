"""Finding an executable by key, through every layer, compiling as a last resort:

    disk (this host) -> remote store (other hosts) -> compile service (pooled
    compiling for this host) -> compile here, one process per key per host
    (or, inside a torch.distributed job, one rank per key for the job)

Each layer that misses is filled on the way back, so the next process stops
earlier. Every execution mode (eager, adaptive, torch.compile) comes here
through the in-memory cache.
"""

from __future__ import annotations

import contextlib
import threading
import time

from .. import trace
from . import leader, target_check
from .disk import disk_cache
from .key import key_components
from .remote import remote_store


class LayerStats:
    def __init__(self):
        self.lock = threading.Lock()
        self.counts = {"compiled": 0, "disk": 0, "remote": 0, "service": 0, "peer": 0}

    def add(self, source: str) -> None:
        with self.lock:
            self.counts[source] = self.counts.get(source, 0) + 1


stats = LayerStats()


def fetch_or_compile(key: str, mlir: str, what: str, target: tuple, use_service: bool = True,
                     components: dict | None = None) -> tuple:
    """(vmfb, compile seconds, source); source is where the executable came
    from: disk, remote, service, peer (another rank) or compiled (here).
    `components`: the key's components (key.py), where the caller has them."""
    if components is None:
        components = key_components(mlir, *target)
    watching = trace.sink
    if watching is None:
        return _fetch_or_compile(key, mlir, what, target, use_service, components)
    started = time.time_ns()
    opened = watching.opened("compile", str(what), started, key=key)  # shown even if the session stops first
    vmfb, seconds, source = _fetch_or_compile(key, mlir, what, target, use_service, components)
    watching.host("compile", str(what), started, time.time_ns(), opened=opened, layer=source, key=key,
                  compile_seconds=round(seconds, 4))
    return vmfb, seconds, source


def _fetch_or_compile(key: str, mlir: str, what: str, target: tuple, use_service: bool, components: dict) -> tuple:
    from ..compiler import compile_mlir
    from .service_client import ServiceUnavailable, service_client

    disk = disk_cache()
    remote = remote_store()
    if disk is not None:
        vmfb = disk.get_executable(key, target)
        if vmfb is not None:
            stats.add("disk")
            return vmfb, 0.0, "disk"
    if remote is not None:
        vmfb = remote.get(key)
        if vmfb is not None and target_check.mismatch(vmfb, *target) is None:
            if disk is not None:
                disk.put_executable(key, vmfb, dict(_meta(components, what, 0.0), source="remote"))
            stats.add("remote")
            return vmfb, 0.0, "remote"
    client = service_client() if use_service else None
    if client is not None:
        try:
            vmfb, seconds, _ = client.compile(key, mlir, what, target)
        except ServiceUnavailable:
            pass  # compile here (the client warned once)
        else:
            if disk is not None and not disk.has_executable(key):
                disk.put_executable(key, vmfb, _meta(components, what, seconds))
            stats.add("service")
            return vmfb, seconds, "service"

    def compile_here() -> tuple:
        # One process per key per host: the others wait, then read the disk.
        with disk.lock("exe-" + key) if disk is not None else contextlib.nullcontext(False):
            if disk is not None:
                vmfb = disk.get_executable(key, target)
                if vmfb is not None:
                    return vmfb, 0.0, "disk"
            vmfb, seconds = compile_mlir(mlir, what, target=target)
            if disk is not None:
                disk.put_executable(key, vmfb, _meta(components, what, seconds))
            if remote is not None:
                remote.put(key, vmfb, what=what)
            return vmfb, seconds, "compiled"

    if leader.active():
        vmfb, seconds, source = leader.compile_or_fetch(key, compile_here)
        if source == "peer" and disk is not None and not disk.has_executable(key):
            disk.put_executable(key, vmfb, dict(_meta(components, what, 0.0), source="peer"))
    else:
        vmfb, seconds, source = compile_here()
    stats.add(source)
    return vmfb, seconds, source


def _meta(components: dict, what: str, seconds: float) -> dict:
    # Every entry records its components (whichever layer it came from), so
    # `cache explain` can read them and `cache import` can check them.
    return {"what": what, "compile_seconds": round(seconds, 4), "components": components}
