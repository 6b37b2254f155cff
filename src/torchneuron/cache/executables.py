"""The compile path every execution mode takes: an MLIR module in, a loaded
executable out, through every cache layer (memory, disk, remote, compile
service) and compiled only when none has it.

    executable_for(mlir, what, target)
      -> data tiling kept only for modules with a large matmul (compiler/data_tiling.py)
      -> the key's components and key (key.py), computed once
      -> the in-memory LRU (memory.py): one compile per key, however many callers
      -> layers.fetch_or_compile: disk, Redis, leader rank, compile service, compile
"""

from __future__ import annotations

import contextlib

from ..compiler import CompileError, NotCompilable, data_tiling
from ..compiler.progress import progress
from ..runtime import LoadedExecutable
from . import layers
from .disk import disk_cache
from .key import cache_key, key_components, key_of
from .memory import executable_cache


def executable_for(mlir: str, what: str, target: tuple, submit=None, show_progress: bool = True):
    """The loaded executable of an MLIR module, through every cache layer
    (memory, disk, remote, compile service) and compiled only when none has
    it; every execution mode compiles through here. `submit` runs the compile
    (a pool's submit; None: in this thread). Data tiling is kept only for
    modules with a large matmul, and a module it fails to compile is compiled
    again without it (data_tiling.py). Raises NotCompilable."""
    target = data_tiling.for_module(mlir, target)
    untiled = data_tiling.without(target)
    if untiled is not None and _stored(mlir, untiled):  # an earlier run found that only this compiles
        target = untiled
    try:
        return _executable_for(mlir, what, target, submit, show_progress)
    except NotCompilable:
        if untiled is None or target is untiled:
            raise
    return _executable_for(mlir, what, untiled, submit, show_progress)


def _executable_for(mlir, what, target, submit, show_progress):
    components = key_components(mlir, *target)  # hashed once: the layers store them beside the entry
    key = key_of(components)

    def compile_executable():
        with progress.compiling() if show_progress else contextlib.nullcontext():
            vmfb, seconds, source = layers.fetch_or_compile(key, mlir, what, target, components=components)
        return LoadedExecutable(vmfb, key, what), len(vmfb), seconds, source

    future = executable_cache().get_or_compile(key, compile_executable, submit or (lambda fn: fn()))
    try:
        return future.result()
    except CompileError as e:
        raise NotCompilable(str(e)) from None


def _stored(mlir: str, target: tuple) -> bool:
    key = cache_key(mlir, *target)
    if key in executable_cache():
        return True
    disk = disk_cache()
    return disk is not None and disk.has_executable(key)
