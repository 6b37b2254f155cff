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
