"""Where the layers report what a profiler session shows (profiler/recorder.py).

`sink` is None unless torch.profiler records device activity, so a layer
pays one module-attribute read. The session receives:

- `ran(index, stream, what, start_ns, end_ns)`: a launch run inline;
- `queued(index, stream, what, issued_ns, semaphore, value)`: a launch
  queued on a timeline (it ends when the semaphore reaches the value);
- `host(kind, name, start_ns, end_ns, **details)`: work on the host:
  "compile", "host op", "transfer", "synchronize".

A leaf module: every layer may import it.
"""

sink = None


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
