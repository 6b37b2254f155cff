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


_pool = None
_lock = threading.Lock()


def compile_pool() -> CompilePool:
    global _pool
    with _lock:
        workers = config.settings.compile_workers or max(1, os.cpu_count() or 1)
        if _pool is None or _pool.workers != workers:
            _pool = CompilePool(workers)
        return _pool
