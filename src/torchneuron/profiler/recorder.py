"""What the kineto plugin (csrc/profiler.cpp) collects: device events.

The plugin calls `start`, `stop` and `collect` on the object installed with
`_C.set_profiler_api`. While a session records, the device queues tell this
module of every launch (`runtime.queue.observer`):

- an inline launch runs on the calling thread: its start and end are known;
- a queued launch is known when it was issued and at which value of its
  stream's timeline it ends; a watcher thread stamps the time the device
  reached that value. It started when it was issued or when the launch
  before it on the same timeline ended, whichever is later (a timeline runs
  its launches in order).

Each event keeps the correlation id of the CPU op being dispatched when it
was issued (kineto links the two) and the user's source line.
"""

from __future__ import annotations

import os
import queue as _queue
import threading
import time

import torch

from .. import _C, trace
from ..runtime.errors import user_location

_sequence_nr = torch._C._autograd._get_sequence_nr  # the next autograd node's number (this thread's)
_current_node = torch._C._current_autograd_node

LAUNCH, COPY, RUNTIME, CALL = 0, 1, 2, 3  # event kinds, as csrc/profiler.cpp maps them
_FLOWS = 1 << 24  # flow ids of launch arrows, clear of kineto's own
# Rows of host work on the device's timeline view (csrc/profiler.cpp names them).
ROWS = {"compile": -1, "lower": -1, "host op": -2, "transfer": -3, "synchronize": -4}


# A launch: [device, stream, what, members, issued, ended (None until the device
# reached it), correlation, (file, line), called (when the host was done
# issuing it), thread]. A list, made on the launch path: cheap to build.
_ENDED = 5


def _launch(index, stream, what, issued, ended, called) -> list:
    members = () if type(what) is str else getattr(what, "members", ())  # a fused graph's ops and lines
    # user_location: cached per code object, formatted only when the events are collected.
    return [index, stream, str(what), members, issued, ended, _C.correlation_id(), user_location(), called,
            _native_id()]


_native_id = threading.get_native_id


_NEAREST_DEPTH = 4  # autograd nodes searched for a line, breadth first


class _Session:
    """One recording: the launches it saw, in issue order."""

    def __init__(self):
        self.launches: list = []
        self.host_work: list = []  # (kind, name, start, end, correlation, details)
        self.open: dict = {}  # work begun and not yet ended: key -> (kind, name, start, correlation, details)
        self.next_open = 0
        self.stopped = None
        self.forward_lines: dict = {}  # autograd node sequence number -> (file, line) of its forward op
        self.lock = threading.Lock()
        self.todo: _queue.SimpleQueue = _queue.SimpleQueue()
        self.watcher = threading.Thread(target=self._watch, name="neuron-profiler", daemon=True)
        self.watcher.start()

    # -- trace.sink -----------------------------------------------------------

    def ran(self, index, stream, what, started, ended) -> None:
        self.launches.append(_launch(index, stream, what, started, ended, ended))  # append: atomic

    def queued(self, index, stream, what, issued, semaphore, value) -> None:
        launch = _launch(index, stream, what, issued, None, time.time_ns())
        self.launches.append(launch)
        self.todo.put((launch, semaphore, value))

    def host(self, kind, name, started, ended, opened=None, **details) -> None:
        if kind not in ("compile", "lower"):  # builds run on background threads: no line of the program's
            if "source" not in details:
                file, line = user_location()
                details["source"] = f"{file}:{line}" if line else file
        item = (kind, name, started, ended, _C.correlation_id(), details)
        with self.lock:
            self.host_work.append(item)
            self.open.pop(opened, None)

    def forward_at(self, filename, line) -> None:
        """An op issued from the user's line: its autograd node (created just
        before its kernel ran) gets that line, so its backward ops, which run
        on autograd's device thread with no frame of the user's, show it too.
        The first op issued after a node was created is the node's own."""
        self.forward_lines.setdefault(_sequence_nr() - 1, (filename, line))

    def backward_line(self):
        """The forward line of the backward node running now; for a node
        whose forward op never reached the device (a view such as split, whose
        backward is a cat), that of the nearest node it feeds gradients to
        (the op that made the viewed tensor)."""
        node = _current_node()
        if node is None:
            return None
        lines = self.forward_lines
        seen, frontier = set(), [node]
        for _ in range(_NEAREST_DEPTH):
            following = []
            for n in frontier:
                line = lines.get(n._sequence_nr())
                if line is not None:
                    return line
                for nxt, _ in n.next_functions:
                    if nxt is not None and id(nxt) not in seen:
                        seen.add(id(nxt))
                        following.append(nxt)
            frontier = following
        return None

    def opened(self, kind, name, started, **details) -> int:
        """Work that has begun (a compile): if the session stops before its
        `host` call, it is shown as still running at the stop."""
        item = (kind, name, started, _C.correlation_id(), details)
        with self.lock:
            key = self.next_open = self.next_open + 1
            self.open[key] = item
        return key

    def _watch(self) -> None:
        while True:
            item = self.todo.get()
            if item is None:
                return
            launch, semaphore, value = item
            try:
                semaphore.wait(value)  # releases the GIL while it waits
            except Exception:  # noqa: BLE001 - a failed launch: its end is when it was seen failed
                pass
            launch[_ENDED] = time.time_ns()
            del item, semaphore  # hold no semaphore while idle

    def finish(self, timeout: float = 60.0) -> None:
        """Wait (bounded) until every queued launch seen is stamped."""
        self.stopped = time.time_ns()
        self.todo.put(None)
        self.watcher.join(timeout)

    def events(self) -> list:
        last_end: dict = {}  # (device, stream) -> when its previous launch ended
        pid = os.getpid()
        out = []
        for order, (index, stream, what, members, issued, ended, correlation, (file, line), called,
                    thread) in enumerate(self.launches):
            if ended is None:
                continue  # still running when the session ended
            row = (index, stream)
            start = max(issued, last_end.get(row, 0))
            last_end[row] = ended
            details = {"source": members[0][1] if members else (f"{file}:{line}" if line else file), "launch": what}
            if members:
                details["ops"] = "; ".join(f"{name} at {where}" for name, where in members)
            flow = _FLOWS + order
            out.append((LAUNCH, _name(what), start, ended, index, stream, correlation, details, -flow))
            # The host side, as CUDA's cudaLaunchKernel: on the issuing thread, with the arrow.
            out.append((CALL, "neuron launch", issued, called, pid, thread, correlation, {"launch": what}, flow))
        with self.lock:
            host_work = list(self.host_work)
            stopped = self.stopped or time.time_ns()
            host_work += [(kind, name, started, stopped, correlation, dict(details, running_at_stop=True))
                          for kind, name, started, correlation, details in self.open.values()]
        for kind, name, started, ended, correlation, details in host_work:
            out.append((COPY if kind == "transfer" else RUNTIME, f"{kind}: {name}", started, ended,
                        details.get("device", 0), ROWS[kind], correlation,
                        {k: str(v) for k, v in dict(details, kind=kind).items()}, 0))
        return out


def _name(what: str) -> str:
    """The event's name: the op (aten.add.Tensor) or 'fused graph [...]'."""
    if what.startswith("fused graph"):
        return what.split(" from ", 1)[0]
    return what.split("(", 1)[0]


_session = None


class _Api:
    """What csrc/profiler.cpp calls (with the GIL held)."""

    def start(self) -> None:
        global _session
        _session = _Session()
        trace.sink = _session

    def stop(self) -> None:
        session = _session
        trace.sink = None
        if session is not None:
            session.finish()

    def collect(self) -> list:
        global _session, last_events
        session, _session = _session, None
        last_events = session.events() if session is not None else []
        return last_events


last_events: list = []  # the last session's events, for export.py


_C.set_profiler_api(_Api())
