"""A bounded pool of compile workers. IREE's compiler releases the GIL, so
compiles run in parallel with each other and with Python."""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from .. import config


class CompilePool:
    def __init__(self, workers: int):
        self.workers = max(1, workers)
        self._executor = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="neuron-compile")

    def submit(self, fn, *args) -> Future:
        return self._executor.submit(fn, *args)


def background_pool(name: str, workers: int) -> ThreadPoolExecutor:
    """A pool for work the program must not wait for or be slowed by:
    its threads run at a lower scheduling priority (compiles they start
    inherit it), and at exit the work not started yet is dropped (what is
    running finishes and lands in the caches for the next run)."""
    pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix=name, initializer=_lower_priority)
    threading._register_atexit(pool.shutdown, wait=False, cancel_futures=True)
    return pool


def _lower_priority() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (OSError, AttributeError):
        pass


def default_workers() -> int:
    return config.settings.compile_workers or max(1, os.cpu_count() or 1)


_pool = None
_lock = threading.Lock()


def compile_pool() -> CompilePool:
    global _pool
    with _lock:
        workers = default_workers()
        if _pool is None or _pool.workers != workers:
            _pool = CompilePool(workers)
        return _pool
