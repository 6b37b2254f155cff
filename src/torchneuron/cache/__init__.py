"""Executables by key: the in-memory LRU and the layers below it (disk,
Redis, the compile service's client, leader-compiles), and the compile path
every mode takes through them (executables.py)."""

from ..compiler import target_cpu
from .disk import TargetStore
from .key import cache_key
from .memory import ExecutableCache, executable_cache

target_cpu.store = TargetStore()  # resolved CPUs kept in the disk cache across processes

__all__ = ["ExecutableCache", "cache_key", "executable_cache"]
