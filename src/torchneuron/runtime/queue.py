"""One launch queue per device, ordered by a HAL timeline semaphore.

Launch n waits for value n-1 and signals n, so launches run in order on IREE's
worker threads while Python goes on. Tensors a launch uses are kept alive
until it is known to be done. Reading on the host (`synchronize`) waits for the
last value; a failed launch is raised there, naming the op, its shapes and the
user's source line.
"""

from __future__ import annotations

import ctypes
import threading
from collections import deque

import numpy as np

from .. import _C, config
from ..device.hal import hal_device
from .errors import NeuronAsyncError

_instance = None
_queues: dict = {}


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _init_types():
    global _MEMORY_TYPE, _BUFFER_USAGE, _ELEMENT_TYPES
    import iree.runtime as ireert
    import torch

    E = ireert.HalElementType
    _MEMORY_TYPE = int(ireert.MemoryType.DEVICE_LOCAL | ireert.MemoryType.HOST_VISIBLE)
    _BUFFER_USAGE = int(ireert.BufferUsage.DEFAULT)
    _ELEMENT_TYPES = {
        torch.float32: E.FLOAT_32, torch.float16: E.FLOAT_16, torch.bfloat16: E.BFLOAT_16,
        torch.float64: E.FLOAT_64, torch.int8: E.SINT_8, torch.int16: E.SINT_16,
        torch.int32: E.SINT_32, torch.int64: E.SINT_64, torch.uint8: E.UINT_8, torch.bool: E.BOOL_8,
    }


_MEMORY_TYPE = _BUFFER_USAGE = 0
_MAX_CACHED_VIEWS = 8192
_ELEMENT_TYPES: dict = {}
_lock = threading.Lock()


def _vm_instance():
    global _instance
    if _instance is None:
        import iree.runtime as ireert

        _instance = ireert.VmInstance()
    return _instance


class DeviceQueue:
    def __init__(self, index: int):
        import iree.runtime as ireert

        if not _ELEMENT_TYPES:
            _init_types()
        self._rt = ireert
        self.index = index
        self.device = hal_device(index)
        self.instance = _vm_instance()
        self.hal_module = ireert.create_hal_module(self.instance, self.device)
        self.semaphore = self.device.create_semaphore(0)
        self.value = 0  # last value signalled by a launch
        self.completed = 0  # highest value known to be reached
        self._pending: deque = deque()  # (value, keepalive, what, source)
        self._lock = threading.RLock()
        self._no_results = ireert.VmVariantList(0)
        self._views: dict = {}  # (address, shape, dtype) -> HalBufferView
        self.cached_views = self._views  # read directly on the hot path
        self.launches = 0

    def import_memory(self, tensor, byte_offset: int, shape, dtype):
        """A buffer view over `shape` elements of a tensor's storage from
        byte_offset (64-byte aligned), without a copy. Imported with full access:
        executables may overwrite it whole (fills, copies).

        Views are cached by address, shape and dtype: the allocator hands the
        same blocks out again, so a steady loop imports nothing. A cached view
        holds the address only (no reference to the storage, which would keep
        it alive); it is used only while a live tensor owns that memory, as
        the launch that uses it keeps the tensor alive."""
        address = tensor.data_ptr() - tensor.storage_offset() * tensor.element_size() + byte_offset
        key = (address, shape, dtype)
        view = self._views.get(key)
        if view is not None:
            return view
        rt = self._rt
        nbytes = _numel(shape) * dtype.itemsize
        if nbytes == 0:
            host = _C.host_bytes(tensor, byte_offset, 0).numpy()
        else:
            host = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))
        buffer = self.device.allocator.import_host_allocation(host, _MEMORY_TYPE, _BUFFER_USAGE)
        view = rt.HalBufferView(buffer, shape, _ELEMENT_TYPES[dtype])
        if nbytes:
            if len(self._views) >= _MAX_CACHED_VIEWS:
                del self._views[next(iter(self._views))]  # oldest first
            self._views[key] = view
        return view

    def launch(self, executable, views: list, keepalive, what: str, source: str, flag=None) -> None:
        """Queue one executable. `flag`, if given, is a device bool the
        executable sets when its indices were out of range."""
        context, fn = executable.entry(self)
        rt = self._rt
        with self._lock:
            args = rt.VmVariantList(len(views) + 2)
            for view in views:
                args.push_ref(view)
            args.push_ref(rt.HalFence.create_at(self.semaphore, self.value))
            self.value += 1
            args.push_ref(rt.HalFence.create_at(self.semaphore, self.value))
            self._pending.append((self.value, keepalive, what, source, flag))
            self.launches += 1
            try:
                context.invoke(fn, args, self._no_results)
            except Exception as e:  # the launch itself was refused
                self._pending.pop()
                self.value -= 1
                raise NeuronAsyncError(f"neuron: launching {what} (issued at {source}) failed: {e}") from e
            if config.settings.launch_blocking:
                self.synchronize()
            else:
                # Retire what has finished at every launch: tensors a finished
                # launch kept alive are let go at once, so their reference
                # counts (which autograd reads to accumulate gradients in
                # place or not) do not depend on how far behind the device is.
                # Wait only if the device is too far behind.
                try:
                    reached = self.semaphore.query()
                except Exception:  # noqa: BLE001 - a failed launch: _wait_for raises it
                    reached = self.completed
                if reached > self.completed:
                    self._retire(reached)
                if len(self._pending) > config.settings.max_in_flight:
                    self._wait_for(self._pending[0][0])

    def synchronize(self) -> None:
        with self._lock:
            if self._pending:
                self._wait_for(self.value)

    def _wait_for(self, value: int) -> None:
        try:
            self.semaphore.wait(value)
        except Exception as e:
            self._raise_failure(e)
        self._retire(value)

    def _retire(self, value: int) -> None:
        pending = self._pending
        bad = None
        while pending and pending[0][0] <= value:
            entry = pending.popleft()
            flag = entry[4]
            if flag is not None and bad is None and _C.host_alias(flag).item():
                bad = entry
        self.completed = max(self.completed, value)
        if bad is not None:
            _, _, what, source, _ = bad
            raise NeuronAsyncError(
                f"neuron: {what} (issued at {source}) used an index out of range "
                "(device-side check; the indices were clamped and its results are invalid)"
            )

    def _raise_failure(self, error: Exception) -> None:
        try:
            reached = self.semaphore.query()
        except Exception:  # noqa: BLE001 - a failed semaphore may refuse queries
            reached = self.completed
        failed = next((p for p in self._pending if p[0] > reached), None)
        self._pending.clear()
        # The timeline is poisoned: continue on a fresh one.
        self.semaphore = self.device.create_semaphore(0)
        self.value = self.completed = 0
        if failed is None:
            raise NeuronAsyncError(f"neuron: an asynchronous op failed: {error}") from error
        _, _, what, source, _ = failed
        raise NeuronAsyncError(
            f"neuron: {what} failed on neuron:{self.index} (issued at {source}): {error}"
        ) from error

    def pending(self) -> int:
        return len(self._pending)


def device_queue(index: int) -> DeviceQueue:
    queue = _queues.get(index)
    if queue is None:
        with _lock:
            queue = _queues.get(index)
            if queue is None:
                queue = _queues[index] = DeviceQueue(index)
    return queue


def synchronize(index: int) -> None:
    queue = _queues.get(index)
    if queue is not None:
        queue.synchronize()


def synchronize_all() -> None:
    for queue in list(_queues.values()):
        queue.synchronize()


def shutdown() -> None:
    """Finish queued work and release IREE objects before the interpreter tears down."""
    global _instance
    try:
        synchronize_all()
    except Exception:  # noqa: BLE001 - nothing to report to at exit
        pass
    _queues.clear()
    _instance = None
