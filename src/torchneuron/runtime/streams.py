"""Streams and events on the device's timelines (runtime/queue.py).

The C++ guard (csrc/guard.cpp) forwards torch.Stream and torch.Event calls
here. An event is a point on one stream's timeline: (semaphore, value) when it
was recorded. `Stream.wait_event` adds that point to the waiting stream's next
launch's wait fence, so the device orders the two streams and the host does
not wait. Timed events get a device completion time from a watcher thread per
stream, which wakes when the timeline reaches the event's value.
"""

from __future__ import annotations

import queue as _queue
import threading
import time

from .. import _C
from .queue import device_queue, queue_recorded


class _Point:
    """Where an event was recorded: a value on one stream's timeline."""

    __slots__ = ("index", "stream", "semaphore", "value", "timed", "done_at", "stamped")

    def __init__(self, index, stream, semaphore, value, timed):
        self.index = index
        self.stream = stream
        self.semaphore = semaphore
        self.value = value
        self.timed = timed
        self.done_at = None  # perf_counter() when the device reached the point
        self.stamped = threading.Event() if timed else None

    def reached(self) -> bool:
        try:
            return self.semaphore.query() >= self.value
        except Exception:  # noqa: BLE001 - a failed timeline: its sync raises the failure
            return True


_events: dict = {}  # event id -> _Point of its last record()
_watchers: dict = {}  # (device index, stream) -> _Watcher


class _Watcher:
    """Stamps timed events of one stream with the time the device reached them."""

    def __init__(self):
        self.todo: _queue.SimpleQueue = _queue.SimpleQueue()
        threading.Thread(target=self._run, name="neuron-event-watcher", daemon=True).start()

    def _run(self) -> None:
        while True:
            point = self.todo.get()
            try:
                point.semaphore.wait(point.value)  # releases the GIL while it waits
            except Exception:  # noqa: BLE001 - a failed timeline: its sync raises the failure
                pass
            point.done_at = time.perf_counter()
            point.stamped.set()
            del point  # hold no semaphore while idle (IREE's objects must go before exit)


def record_event(event_id: int, index: int, stream: int, timed: bool) -> None:
    queue_recorded(index, "event record")  # adaptive eager: recorded work is queued first
    timeline = device_queue(index).timeline(stream)
    point = _Point(index, stream, timeline.semaphore, timeline.value, timed)
    _events[event_id] = point
    if timed:
        if point.reached():
            point.done_at = time.perf_counter()
            point.stamped.set()
        else:
            watcher = _watchers.get((index, stream))
            if watcher is None:
                watcher = _watchers[(index, stream)] = _Watcher()
            watcher.todo.put(point)


def wait_event(event_id: int, index: int, stream: int) -> None:
    """Make `stream`'s later work wait for the event, on the device."""
    point = _events.get(event_id)
    if point is None:
        return
    queue_recorded(index, "event wait")
    if point.reached():
        return
    if point.index != index:
        # Timelines of two devices: the host waits (no cross-device fences).
        synchronize_event(event_id)
        return
    timeline = device_queue(index).timeline(stream)
    if timeline.semaphore is not point.semaphore:
        timeline.waits.append((point.semaphore, point.value))


def query_event(event_id: int) -> bool:
    point = _events.get(event_id)
    return point is None or point.reached()


def synchronize_event(event_id: int) -> None:
    point = _events.get(event_id)
    if point is None:
        return
    try:
        point.semaphore.wait(point.value)
    except Exception:  # noqa: BLE001 - the stream's sync names the failed op
        device_queue(point.index).synchronize(point.stream)
        raise


def destroy_event(event_id: int) -> None:
    _events.pop(event_id, None)


def elapsed_time(start_id: int, end_id: int) -> float:
    """Milliseconds between the device reaching two timed events."""
    start, end = _events.get(start_id), _events.get(end_id)
    if start is None or end is None:
        raise RuntimeError("Both events must be recorded before calculating elapsed time.")
    for event_id, point in ((start_id, start), (end_id, end)):
        synchronize_event(event_id)
        point.stamped.wait()
    return (end.done_at - start.done_at) * 1000.0


def query_stream(index: int, stream: int) -> bool:
    queue_recorded(index, "stream query")
    timeline = device_queue(index).timeline(stream)
    return timeline.reached() >= timeline.value


def synchronize_stream(index: int, stream: int) -> None:
    queue_recorded(index, "sync")
    device_queue(index).synchronize(stream)


class hold:
    """Hold back a stream's device work until `release()` (or `fail(message)`):
    launches queued on it from now on wait for a gate the host opens.

    For tests and for finding missing waits: work on other streams that reads
    this stream's results without an event reads them before they are written.
    Anything that waits for the held work on the host (a host sync, a copy to
    the host, an op on the host fallback, a launch that reads runtime scalars
    on the host) waits until the gate opens: `release_after` seconds opens it
    from a timer thread so such a wait ends. A context manager that releases
    on exit."""

    def __init__(self, stream, release_after: float | None = None):
        index = stream.device_index
        queue_recorded(index, "hold")
        timeline = device_queue(index).timeline(stream.stream_id)
        self._gate = timeline.device.create_semaphore(0)
        timeline.waits.append((self._gate, 1))
        self._timer = None
        if release_after is not None:
            self._timer = threading.Timer(release_after, self._open)
            self._timer.daemon = True
            self._timer.start()

    def _open(self) -> None:
        try:
            self._gate.signal(1)
        except Exception:  # noqa: BLE001 - already failed or released
            pass

    def release(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._open()

    def fail(self, message: str) -> None:
        """Fail the held work as a device error would (raised at the next sync)."""
        if self._timer is not None:
            self._timer.cancel()
        self._gate.fail(message)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()
        return False


def _forget() -> None:
    """At exit: drop the semaphores events hold before IREE's bindings go."""
    _events.clear()


def _install() -> None:
    import atexit
    import sys

    _C.set_stream_api(sys.modules[__name__])
    atexit.register(_forget)


_install()

__all__ = ["hold"]
