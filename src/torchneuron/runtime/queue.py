"""One launch queue per device, with one timeline per stream.

Each stream of a device is a HAL timeline semaphore: its launch n waits for
value n-1 (and for the events the stream was told to wait for) and signals n,
so launches run in order on IREE's worker threads while Python goes on, and
two streams' launches are ordered only by events. Small launches run inline
instead, which costs less than handing them to a worker. Tensors a launch uses
are kept alive until it is known to be done, so their memory is not reused
while any stream still uses it. Reading on the host (`synchronize`) waits for
every stream; the earliest failed launch is raised there, naming the op, its
shapes and the user's source line.
"""

from __future__ import annotations

import ctypes
import itertools
import math
import threading
import time
from collections import deque

import numpy as np

from .. import _C, config, trace
from ..hal.devices import hal_device, inline_device
from ..memory.device_memory import FlagCopy, device_memory
from . import memory_guards
from .errors import NeuronAsyncError, user_source_line

_instance = None
_queues: dict = {}
# Called with (device index, reason) before the host waits for that device or
# before work that bypasses recording is queued (a torch.compile graph): work
# recorded but not yet queued (adaptive eager) is queued first.
before_sync: list = []


def queue_recorded(index, reason: str) -> None:
    """Queue work recorded for device `index` (None: every device) but not yet queued."""
    for hook in before_sync:
        hook(index, reason)


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
        torch.complex64: E.COMPLEX_64, torch.complex128: E.COMPLEX_128,
        # float8_e4m3fn is also the carrier of 8-bit integers an executable
        # writes (lowering/carriers.py).
        torch.float8_e4m3fn: E.FLOAT_8_E4M3_FN, torch.float8_e5m2: E.FLOAT_8_E5M2,
        torch.float8_e4m3fnuz: E.FLOAT_8_E4M3_FNUZ, torch.float8_e5m2fnuz: E.FLOAT_8_E5M2_FNUZ,
        torch.float8_e8m0fnu: E.FLOAT_8_E8M0_FNU,
    }


_MEMORY_TYPE = _BUFFER_USAGE = 0
_MAX_CACHED_VIEWS = 8192
_ELEMENT_TYPES: dict = {}
_lock = threading.Lock()
_issued = itertools.count()  # launch order across streams: the earliest failure is raised first


def _vm_instance():
    global _instance
    if _instance is None:
        import iree.runtime as ireert

        _instance = ireert.VmInstance()
    return _instance


class Lane:
    """One stream's in-order timeline on one HAL device: launch n waits for
    value n-1 and signals n; an inline lane (local-sync) runs each launch
    synchronously instead, after its stream's timeline. Imports host memory
    into its device (views cached by address, shared by the device's lanes)."""

    def __init__(self, device, inline: bool, base: "Lane | None" = None, stream: int = 0):
        import iree.runtime as ireert

        self._rt = ireert
        self.device = device
        self.inline = inline  # runs each launch on the calling thread
        self.stream = stream
        # Lanes of one device share the loaded executables and imported views.
        self.base = base or self
        self.hal_module = ireert.create_hal_module(_vm_instance(), device) if base is None else base.hal_module
        self.views: dict = {} if base is None else base.views  # (address, shape, dtype) -> HalBufferView
        self.semaphore = device.create_semaphore(0)
        self.value = 0  # last value signalled by a launch
        self.completed = 0  # highest value known to be reached
        self.pending: deque = deque()  # (value, keepalive, what, source, flag, order)
        # Other timelines' points (semaphore, value) the next launch waits for
        # (events); launches up to `waits_until` depend on other timelines.
        self.waits: list = []
        self.waits_until = 0
        self.timeline = self  # an inline lane: its stream's task lane, which it runs after
        self.launches = 0
        self._no_results = ireert.VmVariantList(0)
        # The device's buffers on the discrete memory model (None: unified,
        # where storages are host memory imported in place).
        self.memory = None if base is None else base.memory

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
        if self.memory is not None:
            return self.memory.view_at(address, shape, dtype)
        view = self.views.get((address, shape, dtype))
        if view is not None:
            return view
        if math.prod(shape) == 0:
            host = _C.host_bytes(tensor, byte_offset, 0).numpy()
            buffer = self.device.allocator.import_host_allocation(host, _MEMORY_TYPE, _BUFFER_USAGE)
            return self._rt.HalBufferView(buffer, shape, _ELEMENT_TYPES[dtype])
        return self.import_at(address, shape, dtype)

    def import_at(self, address: int, shape, dtype):
        """A buffer view over `shape` elements of device memory at `address`
        (64-byte aligned, not empty), without a copy; cached as import_memory's."""
        if self.memory is not None:
            return self.memory.view_at(address, shape, dtype)
        key = (address, shape, dtype)
        view = self.views.get(key)
        if view is not None:
            return view
        nbytes = math.prod(shape) * dtype.itemsize
        host = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))
        buffer = self.device.allocator.import_host_allocation(host, _MEMORY_TYPE, _BUFFER_USAGE)
        view = self._rt.HalBufferView(buffer, shape, _ELEMENT_TYPES[dtype])
        if len(self.views) >= _MAX_CACHED_VIEWS:
            del self.views[next(iter(self.views))]  # oldest first
        self.views[key] = view
        return view

    def import_numbers(self, values, dtype, index: int):
        """(tensor, view) of a launch's runtime numbers, in device memory:
        the caching allocator hands a loop the same few blocks again, so their
        views are imported once (a host tensor lands at a new address almost
        every launch: an import of about 40 us each). On the discrete model
        the numbers are a small host buffer the device reads, as a GPU reads
        a kernel's arguments."""
        if self.memory is not None:
            view = self.memory.staging_with(np.asarray(values, dtype=np.float64 if dtype.is_floating_point else np.int64))
            view = self._rt.HalBufferView(view, (len(values),), _ELEMENT_TYPES[dtype])
            return view, view
        packed = _C.empty((len(values),), dtype, index)
        _C.host_alias(packed).numpy()[:] = values
        return packed, self.import_memory(packed, 0, (len(values),), dtype)

    def busy(self) -> bool:
        return self.value > self.completed

    def independent(self) -> bool:
        """Whether waiting for this timeline cannot wait for another stream
        (which may be held back): no event waits queued or in flight."""
        return not self.waits and self.waits_until <= self.completed

    def run_inline(self, context, fn, views, what, source=None) -> None:
        """Run the executable's synchronous entry on the calling thread: it is
        finished when this returns, so nothing is kept alive or retired."""
        args = self._rt.VmVariantList(len(views))
        for view in views:
            args.push_ref(view)
        try:
            context.invoke(fn, args, self._no_results)
        except Exception as e:
            raise NeuronAsyncError(f"neuron: {what} (issued at {source or user_source_line()}) failed: {e}") from e
        self.launches += 1

    def fence_before_next(self):
        """What the next submission on this timeline waits for: its last
        value, and the other timelines' points it waits on (events)."""
        waits = self.waits
        if not waits:
            return self._rt.HalFence.create_at(self.semaphore, self.value)
        after = self._rt.HalFence(1 + len(waits))
        after.insert(self.semaphore, self.value)
        for semaphore, value in waits:
            after.insert(semaphore, value)
        return after

    def waits_submitted(self) -> None:
        """The event waits are in a submission: launches up to now depend on other timelines."""
        self.waits = []
        self.waits_until = self.value

    def invoke(self, context, fn, views, keepalive, what, source, flag) -> None:
        rt = self._rt
        args = rt.VmVariantList(len(views) + 2)
        for view in views:
            args.push_ref(view)
        waits = self.waits
        args.push_ref(self.fence_before_next())
        self.value += 1
        args.push_ref(rt.HalFence.create_at(self.semaphore, self.value))
        self.pending.append((self.value, keepalive, what, source, flag, next(_issued)))
        try:
            context.invoke(fn, args, self._no_results)
        except Exception as e:  # the launch itself was refused
            self.pending.pop()
            self.value -= 1
            raise NeuronAsyncError(f"neuron: launching {what} (issued at {source}) failed: {e}") from e
        if waits:
            self.waits_submitted()
        self.launches += 1
        if flag is not None and self.memory is not None:
            self._queue_flag_read(flag, what, source)

    def _queue_flag_read(self, flag, what, source) -> None:
        """On the discrete model a launch's index flag is copied to host
        memory on this timeline, right after the launch, and its retire
        reads that copy. (Read at retire by a submission of its own, running
        beside the work queued since, it lost lavapipe's device under load:
        VK_ERROR_DEVICE_LOST in a training step.) The launch's entry waits
        for the copy."""
        commands, copy = self.memory.copy_out(flag.data_ptr(), flag.numel() * flag.element_size(), flag.dtype)
        try:
            self.device.queue_execute(commands, self._rt.HalFence.create_at(self.semaphore, self.value),
                                      self._rt.HalFence.create_at(self.semaphore, self.value + 1))
        except Exception:  # noqa: BLE001 - not queued: the retire reads the flag itself (flag_set)
            return
        _, keepalive, _, _, _, order = self.pending.pop()
        self.value += 1
        self.pending.append((self.value, (keepalive, flag), what, source, copy, order))

    def reached(self) -> int:
        try:
            return self.semaphore.query()
        except Exception:  # noqa: BLE001 - a failed launch: wait() raises it
            return self.completed

    def wait(self, value: int, index: int):
        """Wait until `value` is reached; the first launch found to have used
        an out-of-range index, or None."""
        try:
            self.semaphore.wait(value)
        except Exception as e:
            self._raise_failure(e, index)
        return self.retire(value)

    def retire(self, value: int):
        """Let go of what launches up to `value` kept alive; the first one
        whose index check failed, or None."""
        pending = self.pending
        bad = None
        while pending and pending[0][0] <= value:
            entry = pending.popleft()
            flag = entry[4]
            if flag is not None and bad is None and self.flag_set(flag):
                bad = entry
        self.completed = max(self.completed, value)
        return bad

    def flag_set(self, flag) -> bool:
        """Whether a finished launch set its index flag."""
        if self.memory is None:
            return bool(_C.host_alias(flag).any())
        if isinstance(flag, FlagCopy):
            return bool(flag.host().any())
        return bool(self.memory.read_now(flag.data_ptr(), flag.numel()).any())

    def host_flag(self, flag):
        """A finished launch's flag tensor, on the host."""
        if self.memory is None:
            return _C.host_alias(flag)
        if isinstance(flag, FlagCopy):
            return flag.host()
        import torch

        return torch.from_numpy(self.memory.read_now(flag.data_ptr(), flag.numel())).view(flag.dtype)

    def _raise_failure(self, error: Exception, index: int) -> None:
        reached = self.reached()
        failed = next((p for p in self.pending if p[0] > reached), None)
        self.pending.clear()
        # The timeline is poisoned: continue on a fresh one.
        self.semaphore = self.device.create_semaphore(0)
        self.value = self.completed = self.waits_until = 0
        self.waits = []
        if failed is None:
            raise NeuronAsyncError(f"neuron: an asynchronous op failed: {error}") from error
        _, _, what, source, _, order = failed
        stream = f" stream {self.stream}" if self.stream else ""
        failure = NeuronAsyncError(f"neuron: {what} failed on neuron:{index}{stream} (issued at {source}): {error}")
        failure.order = order
        raise failure from error


def _not_failed(semaphore) -> bool:
    try:
        semaphore.query()
        return True
    except Exception:  # noqa: BLE001 - a failed timeline: nothing to wait for any more
        return False


class DeviceQueue:
    """The launch queue of one neuron device: a timeline per stream on the HAL
    device, and for the CPU task pool an inline lane per stream that small
    launches run on.

    A stream's inline launch first waits for the stream's timeline, and is
    finished when it returns, so the stream's next launch has nothing to wait
    for. While a stream's timeline depends on another stream (an event wait
    in flight), its small launches queue on the timeline instead: the other
    stream may be held back, and the host must not wait for it. An index
    check that failed is raised at the next sync point, from whichever lane."""

    def __init__(self, index: int):
        if not _ELEMENT_TYPES:
            _init_types()
        self.index = index
        self.task = Lane(hal_device(index), inline=False)  # the default stream's timeline
        self.memory = device_memory(index, _vm_instance(), _ELEMENT_TYPES) if _C.discrete_memory() else None
        self.task.memory = self.memory
        # Inline lanes are another HAL device: its executables could not bind this one's buffers.
        inline = inline_device(index) if config.settings.inline_elements > 0 and self.memory is None else None
        self.inline = Lane(inline, inline=True) if inline is not None else None
        if self.inline is not None:
            self.inline.timeline = self.task
        self.streams: dict = {0: (self.task, self.inline)}  # stream id -> (task lane, inline lane)
        self.side: list = []  # the task lanes of streams other than the default
        self._lock = threading.RLock()
        self._bad = None  # a launch whose index check failed, raised at the next sync
        self.launches = 0

    def lanes(self) -> list:
        """One lane per loaded device (the lanes of other streams share them)."""
        return [self.task] + ([self.inline] if self.inline is not None else [])

    def stream_lanes(self, stream: int) -> tuple:
        """(task lane, inline lane or None) of a stream, made at first use."""
        lanes = self.streams.get(stream)
        if lanes is None:
            with self._lock:
                lanes = self.streams.get(stream)
                if lanes is None:
                    task = Lane(self.task.device, inline=False, base=self.task, stream=stream)
                    inline = None
                    if self.inline is not None:
                        inline = Lane(self.inline.device, inline=True, base=self.inline, stream=stream)
                        inline.timeline = task
                    self.side.append(task)
                    lanes = self.streams[stream] = (task, inline)
        return lanes

    def timeline(self, stream: int) -> Lane:
        return self.task if stream == 0 else self.stream_lanes(stream)[0]

    def lane_for(self, elements: int, stream: int | None = None) -> Lane:
        """The lane for a launch on `stream` (default: the current stream)
        whose largest tensor has `elements` elements."""
        if stream is None:
            stream = _C.current_stream(self.index)
        task, inline = (self.task, self.inline) if stream == 0 else self.stream_lanes(stream)
        if inline is not None and elements <= config.settings.inline_elements and task.independent():
            return inline
        return task

    def launch(self, executable, views: list, keepalive, what: str, flag=None, lane=None, source=None) -> None:
        """Queue one executable on `lane` (default: the default stream's
        timeline), whose imports `views` are. `flag`, if given, is a device
        bool the executable sets when its indices were out of range. Errors
        name the user's source line (`source`, or found only when it is
        needed: an inline launch is still on the user's stack when it fails);
        adaptive eager launches ops recorded earlier, and passes their line."""
        lane = lane or self.task
        context, fn = executable.entry(lane.base)
        if config.settings.check_memory:
            self._launch_checked(lane, context, fn, views, keepalive, what, flag, source)
            return
        watching = trace.sink
        with self._lock:
            if lane.inline:
                timeline = lane.timeline
                if timeline.busy():
                    self._note(timeline.wait(timeline.value, self.index))
                if watching is not None:
                    started = time.time_ns()
                    lane.run_inline(context, fn, views, what, source)
                    watching.ran(self.index, lane.stream, what, started, time.time_ns())
                else:
                    lane.run_inline(context, fn, views, what, source)
                self.launches += 1
                if flag is not None and lane.flag_set(flag):
                    self._note((lane.value, keepalive, what, source or user_source_line(), flag, next(_issued)))
                if config.settings.launch_blocking:
                    self.synchronize()
                return
            issued = time.time_ns() if watching is not None else 0
            try:
                lane.invoke(context, fn, views, keepalive, what, source or user_source_line(), flag)
            except NeuronAsyncError as refused:
                self._refused(refused)
            if watching is not None:
                watching.queued(self.index, lane.stream, what, issued, lane.semaphore, lane.value)
            self.launches += 1
            if config.settings.launch_blocking:
                self.synchronize()
                return
            # Retire what has finished at every launch: tensors a finished
            # launch kept alive are let go at once, so their reference counts
            # (which autograd reads to accumulate gradients in place or not)
            # do not depend on how far behind the device is. Wait only if the
            # device is too far behind.
            reached = lane.reached()
            if reached > lane.completed:
                self._note(lane.retire(reached))
            if self.side:
                self._retire_reached(lane)
            if len(lane.pending) > config.settings.max_in_flight:
                self._note(lane.wait(lane.pending[0][0], self.index))

    def _retire_reached(self, launched) -> None:
        """Let go of what other streams' finished launches kept alive."""
        for lane in (self.task, *self.side):
            if lane is not launched and lane.pending:
                reached = lane.reached()
                if reached > lane.completed:
                    self._note(lane.retire(reached))

    def _launch_checked(self, lane, context, fn, views, keepalive, what, flag, source=None) -> None:
        """A launch under TORCHNEURON_CHECK_MEMORY: run to completion, then check the guards."""
        source = source or user_source_line()
        watching = trace.sink
        with self._lock:
            # Streams that wait for another one are not waited for: it may be held back.
            self._drain([t for t in (self.task, *self.side) if t.independent()])
            memory_guards.poison_freed()  # before a stale write could land in what was freed
            started = time.time_ns() if watching is not None else 0
            if lane.inline:
                lane.run_inline(context, fn, views, what, source)
                if watching is not None:
                    watching.ran(self.index, lane.stream, what, started, time.time_ns())
                if flag is not None and lane.flag_set(flag):
                    self._note((lane.value, keepalive, what, source, flag, next(_issued)))
            else:
                try:
                    lane.invoke(context, fn, views, keepalive, what, source, flag)
                except NeuronAsyncError as refused:
                    self._refused(refused)
                if watching is not None:
                    watching.queued(self.index, lane.stream, what, started, lane.semaphore, lane.value)
            self.launches += 1
            if not lane.timeline.independent():
                return  # checked when the stream is synchronized
            if not lane.inline:
                self._note(lane.wait(lane.value, self.index))
        memory_guards.verify_launch(what, source, keepalive)

    def _refused(self, refused: NeuronAsyncError) -> None:
        """A launch the device refused, most often because work it waits for
        (on this or another stream) failed: that earlier failure is raised
        if there is one, else this refusal."""
        refused.order = next(_issued)
        self._drain(also=refused)
        raise refused

    def _note(self, bad) -> None:
        if bad is not None and (self._bad is None or bad[5] < self._bad[5]):
            self._bad = bad

    def _drain(self, lanes=None, also=None) -> None:
        """Wait for `lanes` (default: every stream); the earliest failure
        (`also` among them) is raised once all have been waited for (caller
        holds the lock)."""
        failures = [also] if also is not None else []
        for lane in lanes if lanes is not None else (self.task, *self.side):
            if lane.pending:
                try:
                    self._note(lane.wait(lane.value, self.index))
                except NeuronAsyncError as e:
                    failures.append(e)
            lane.waits_until = 0
        if failures:
            for lane in (self.task, *self.side):
                lane.waits = [w for w in lane.waits if _not_failed(w[0])]
                if not lane.pending and not _not_failed(lane.semaphore):
                    # Failed by a refused launch (what it waited for failed): a fresh timeline.
                    lane.semaphore = lane.device.create_semaphore(0)
                    lane.value = lane.completed = 0
            raise min(failures, key=lambda e: getattr(e, "order", -1))

    def synchronize(self, stream: int | None = None) -> None:
        """Wait for every stream's work (or one stream's); raise the earliest failure."""
        watching = trace.sink
        started = time.time_ns() if watching is not None else 0
        with self._lock:
            try:
                if stream is None:
                    self._drain()
                else:
                    self._drain([self.timeline(stream)])
            finally:
                if watching is not None:
                    watching.host("synchronize", "synchronize", started, time.time_ns(), device=self.index,
                                  stream=-1 if stream is None else stream)
            bad, self._bad = self._bad, None
        if config.settings.check_memory:
            memory_guards.verify("an op before this synchronization", user_source_line(), thorough=True)
        if bad is not None:
            _, _, what, source, flag, _ = bad
            if hasattr(what, "culprit"):  # a fused graph: name the op whose flag is set
                what, source = what.culprit(self.task.host_flag(flag))
            raise NeuronAsyncError(
                f"neuron: {what} (issued at {source}) used an index out of range "
                "(device-side check; the indices were clamped and its results are invalid)"
            )

    def pending(self) -> int:
        return sum(len(lane.pending) for lane in (self.task, *self.side))

    def submit(self, commands, keepalive, what: str, stream: int = 0) -> int:
        """Queue a command buffer (a transfer) on a stream's timeline (the
        default stream's unless given), after the launches queued before it;
        `keepalive` is held until it is done; returns its timeline value."""
        rt = self.task._rt
        lane = self.timeline(stream)
        with self._lock:
            waits = lane.waits
            after = lane.fence_before_next()
            lane.value += 1
            lane.pending.append((lane.value, keepalive, what, user_source_line(), None, next(_issued)))
            try:
                lane.device.queue_execute(commands, after, rt.HalFence.create_at(lane.semaphore, lane.value))
            except Exception as e:
                lane.pending.pop()
                lane.value -= 1
                raise NeuronAsyncError(f"neuron: {what} on neuron:{self.index} failed: {e}") from e
            if waits:
                lane.waits_submitted()
            return lane.value

    def submit_and_wait(self, commands, what: str) -> None:
        """Queue a command buffer on the default timeline and wait for it."""
        value = self.submit(commands, [], what)
        with self._lock:
            self._note(self.task.wait(value, self.index))


def device_queue(index: int) -> DeviceQueue:
    queue = _queues.get(index)
    if queue is None:
        with _lock:
            queue = _queues.get(index)
            if queue is None:
                queue = _queues[index] = DeviceQueue(index)
    return queue


def synchronize(index: int) -> None:
    queue_recorded(index, "sync")
    queue = _queues.get(index)
    if queue is not None:
        queue.synchronize()


def synchronize_all() -> None:
    queue_recorded(None, "sync")
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
