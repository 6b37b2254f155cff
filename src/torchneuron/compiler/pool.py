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
    """A pool for work the program must not wait for or be slowed by: the
    compilers its threads start run at a lower scheduling priority (see
    lower_priority), and at exit the work not started yet is dropped (what
    is running finishes and lands in the caches for the next run)."""
    pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix=name, initializer=mark_background)
    threading._register_atexit(pool.shutdown, wait=False, cancel_futures=True)
    return pool


_background = threading.local()


def mark_background() -> None:
    """This thread's work is background work (its compiler processes yield)."""
    _background.on = True


def in_background() -> bool:
    return getattr(_background, "on", False)


def lower_priority(pid: int) -> None:
    """Let process `pid` (a compiler this process started from a background
    thread) yield the CPU to the program. Only child processes: a thread of
    this process that yields while holding the GIL (or a lock the program
    needs) would stall the program behind every process at that priority
    (measured: the demo's cold first step in op mode 0.26-0.40 s with the
    background threads themselves lowered, 0.10-0.13 s without)."""
    try:
        os.setpriority(os.PRIO_PROCESS, pid, 10)
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
