"""Executables by key: the in-memory LRU (later layers: disk, compile service, remote)."""

from .key import cache_key
from .memory import ExecutableCache, executable_cache

__all__ = ["ExecutableCache", "cache_key", "executable_cache"]
