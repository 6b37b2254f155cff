"""In-memory executable cache: LRU bounded by entries and bytes; concurrent
requests for one key compile once; statistics. Misses go down the layers
(disk, remote, service, compiler) in `layers.py`."""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future

from .. import config


class ExecutableCache:
    def __init__(self, max_entries: int, max_bytes: int):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict = OrderedDict()  # key -> (value, nbytes)
        self._pending: dict = {}  # key -> Future, compiles in flight
        self._lock = threading.Lock()
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.merged = 0  # requests that joined a compile already in flight
        self.evictions = 0
        self.compile_seconds = 0.0
        self.compiles = 0
        self.failures = 0

    def get_or_compile(self, key: str, compile_fn, submit) -> Future:
        """A future of the value for key. On a miss, `submit(compile_fn)` starts
        the compile (compile_fn returns (value, nbytes, seconds, source), source
        saying which layer produced it); concurrent misses on one key share it."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                done: Future = Future()
                done.set_result(entry[0])
                return done
            pending = self._pending.get(key)
            if pending is not None:
                self.merged += 1
                return pending
            self.misses += 1
            result: Future = Future()
            self._pending[key] = result

        def run():
            try:
                value, nbytes, seconds, source = compile_fn()
            except BaseException as e:  # noqa: BLE001 - handed to every waiter
                with self._lock:
                    self.failures += 1
                    del self._pending[key]
                result.set_exception(e)
                return
            with self._lock:
                if source == "compiled":
                    self.compiles += 1
                    self.compile_seconds += seconds
                existing = self._entries.get(key)
                if existing is None:
                    self._insert(key, value, nbytes)
                else:  # loaded meanwhile by another path (warm start): keep one
                    value = existing[0]
                del self._pending[key]
            result.set_result(value)

        submit(run)
        return result

    def get(self, key: str):
        """The value for key, or None; counts a hit."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry[0]

    def put(self, key: str, value, nbytes: int) -> tuple:
        """(the value now cached for key, whether it is this one): when two
        threads load one key, both use the first."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                return entry[0], False
            self._insert(key, value, nbytes)
            return value, True

    def _insert(self, key, value, nbytes) -> None:
        self._entries[key] = (value, nbytes)
        self.bytes += nbytes
        self._evict()

    def _evict(self) -> None:
        while self._entries and (len(self._entries) > self.max_entries or self.bytes > self.max_bytes):
            _, (_, nbytes) = self._entries.popitem(last=False)
            self.bytes -= nbytes
            self.evictions += 1

    def __contains__(self, key) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def stats(self) -> dict:
        with self._lock:
            return {
                "entries": len(self._entries),
                "bytes": self.bytes,
                "hits": self.hits,
                "misses": self.misses,
                "merged": self.merged,
                "evictions": self.evictions,
                "compiles": self.compiles,
                "compile_failures": self.failures,
                "compile_seconds": round(self.compile_seconds, 3),
            }

    def clear(self) -> None:
        """Forget every entry; each value's `release()` (if it has one) drops
        what it loaded, so values still referenced elsewhere (a compiled
        torch.compile graph) hold no runtime objects past shutdown."""
        with self._lock:
            values = [value for value, _ in self._entries.values()]
            self._entries.clear()
            self.bytes = 0
        for value in values:
            release = getattr(value, "release", None)
            if release is not None:
                release()


_cache = None


def executable_cache() -> ExecutableCache:
    global _cache
    if _cache is None:
        s = config.settings
        _cache = ExecutableCache(s.cache_max_entries, s.cache_max_mb * 1024 * 1024)
    return _cache
