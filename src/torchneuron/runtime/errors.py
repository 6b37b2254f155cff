"""Errors from asynchronous execution, and the user's source line of an op."""

from __future__ import annotations

import os
import sys

import torch

from .. import trace

_SKIP = tuple(
    os.path.dirname(m.__file__) + os.sep
    for m in (torch, sys.modules[__name__.split(".")[0]])
)
# The example models and the demo ship in the package but are a user's code:
# their lines are where device time goes.
_USER = tuple(os.path.join(_SKIP[1], name) for name in ("models.py", "demo.py"))


def is_library_file(filename: str) -> bool:
    """Whether `filename` is torch's or torchneuron's (not the user's) code."""
    return (filename.startswith(_SKIP) and filename not in _USER) or filename.startswith("<frozen")


class NeuronAsyncError(RuntimeError):
    """An op that ran asynchronously failed; raised at the next sync point."""


def user_source_line() -> str:
    """'file:line' of the innermost frame outside torch and torchneuron."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not is_library_file(filename):
            if trace.sink is not None:
                trace.sink.forward_at(filename, frame.f_lineno)
            return f"{filename}:{frame.f_lineno}"
        frame = frame.f_back
    where = _backward_line()
    return f"{where[0]}:{where[1]}" if where else "<unknown>"


def _backward_line():
    """On autograd's device thread no frame is the user's: while a profiler
    records, the line of the forward op whose backward this is."""
    sink = trace.sink
    return sink.backward_line() if sink is not None else None


_skipped: dict = {}  # code object -> whether it is torch's or torchneuron's


def user_location():
    """(filename, line) of the innermost frame outside torch and torchneuron,
    cheaply (per code object, whether to skip it is decided once): adaptive
    eager records one per op and formats it only when it is needed."""
    frame = sys._getframe(1)
    skipped = _skipped
    while frame is not None:
        code = frame.f_code
        skip = skipped.get(code)
        if skip is None:
            filename = code.co_filename
            skip = skipped[code] = is_library_file(filename)
        if not skip:
            if trace.sink is not None:
                trace.sink.forward_at(code.co_filename, frame.f_lineno)
            return code.co_filename, frame.f_lineno
        frame = frame.f_back
    return _backward_line() or ("<unknown>", 0)
