"""Adaptive eager mode: eager ops are recorded into small graphs, each graph
runs as one fused executable, and graphs not compiled yet run op by op while
they compile in the background (recorder -> executor).

Switched with `torchneuron.set_eager_mode("adaptive" | "op")`, the context
manager `torchneuron.eager_mode(...)` or TORCHNEURON_EAGER_MODE.
"""

from __future__ import annotations

import contextlib
import time

from .. import _C, config
from ..dispatch import eager, entry
from ..runtime import queue
from . import executor, recorder, stats


def _apply(mode: str) -> None:
    if mode == "adaptive":
        entry.recording = recorder
    else:
        entry.recording = None
        recorder.flush(None, "mode switch")
    _C.set_fast_mode(_FAST_MODES[mode], recorder.MISS)


_FAST_MODES = {"op": 1, "adaptive": 2}  # see csrc/recording.cpp


def _on_setting(name, value) -> None:
    if name == "eager_mode":
        _apply(value)
    elif name == "adaptive_max_ops":
        _C.set_adaptive_max_ops(value)
    elif name == "adaptive_held_kb":
        _C.set_adaptive_held_bytes(value * 1024)
    elif name == "adaptive_peak_cuts":
        _C.set_adaptive_peak_cuts(value)


def set_eager_mode(mode: str) -> None:
    """"adaptive" (record ops into fused graphs) or "op" (one launch per op)."""
    config.set(eager_mode=mode)


def get_eager_mode() -> str:
    return config.settings.eager_mode


@contextlib.contextmanager
def eager_mode(mode: str):
    """Run a block in one eager mode; pending work is cut at the boundaries."""
    previous = config.settings.eager_mode
    recorder.flush(None, "mode switch")
    set_eager_mode(mode)
    try:
        yield
    finally:
        set_eager_mode(previous)


def wait_for_compiles(timeout: float | None = None) -> bool:
    """Cut pending graphs and wait until every fused graph met twice (the
    first meeting runs op by op) and every op executable met so far is built
    (or known to fail), so later occurrences run compiled; False on timeout."""
    recorder.flush(None, "wait for compiles")
    deadline = None if timeout is None else time.monotonic() + timeout
    if not eager.wait_for_builds(timeout):
        return False
    return executor.wait_for_builds(None if deadline is None else max(0.0, deadline - time.monotonic()))


def _before_sync(index, reason) -> None:
    recorder.flush(index, reason)


queue.before_sync.append(_before_sync)
config.on_change(_on_setting)
_C.set_adaptive_max_ops(config.settings.adaptive_max_ops)
_C.set_adaptive_held_bytes(config.settings.adaptive_held_kb * 1024)
_C.set_adaptive_peak_cuts(config.settings.adaptive_peak_cuts)
_apply(config.settings.eager_mode)

__all__ = ["eager_mode", "executor", "get_eager_mode", "recorder", "set_eager_mode", "stats", "wait_for_compiles"]
