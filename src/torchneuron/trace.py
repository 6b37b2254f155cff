"""Where the layers report what a profiler session shows (profiler/recorder.py).

`sink` is None unless torch.profiler records device activity, so a layer
pays one module-attribute read. The session receives:

- `ran(index, stream, what, start_ns, end_ns)`: a launch run inline;
- `queued(index, stream, what, issued_ns, semaphore, value)`: a launch
  queued on a timeline (it ends when the semaphore reaches the value);
- `host(kind, name, start_ns, end_ns, **details)`: work on the host:
  "compile", "host op", "transfer", "synchronize";
  "lower" (torch to MLIR, see `span`);
- `opened(kind, name, start_ns, **details)`: work begun (a compile), shown
  as running at the stop if its `host(..., opened=)` comes too late;
- `forward_at(file, line)` / `backward_line()`: the user's line of each op,
  kept per autograd node, so backward ops get their forward op's line.

A leaf module: every layer may import it.
"""

import time
from contextlib import contextmanager

sink = None


@contextmanager
def span(kind: str, name: str):
    """Host work of `kind` ("lower") shown while a session records. For
    build paths only: entering costs a generator even when nothing records."""
    watching = sink
    if watching is None:
        yield
        return
    started = time.time_ns()
    opened = watching.opened(kind, name, started)
    try:
        yield
    finally:
        watching.host(kind, name, started, time.time_ns(), opened=opened)


class Traced:
    """A launch's description with the ops it runs and their source lines
    (a fused graph, a torch.compile graph), made only while a session records."""

    __slots__ = ("what", "members")

    def __init__(self, what, members):
        self.what = what
        self.members = members  # ((op name, "file:line"), ...)

    def __str__(self):
        return str(self.what)

    def __getattr__(self, name):  # what.culprit(...) of a fused graph with index checks
        return getattr(self.what, name)
