"""Errors from asynchronous execution, and the user's source line of an op."""

from __future__ import annotations

import os
import sys

import torch

_SKIP = tuple(
    os.path.dirname(m.__file__) + os.sep
    for m in (torch, sys.modules[__name__.split(".")[0]])
)


class NeuronAsyncError(RuntimeError):
    """An op that ran asynchronously failed; raised at the next sync point."""


def user_source_line() -> str:
    """'file:line' of the innermost frame outside torch and torchneuron."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(_SKIP) and not filename.startswith("<frozen"):
            return f"{filename}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>"


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
            skip = skipped[code] = filename.startswith(_SKIP) or filename.startswith("<frozen")
        if not skip:
            return code.co_filename, frame.f_lineno
        frame = frame.f_back
    return "<unknown>", 0
