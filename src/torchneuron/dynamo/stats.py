"""Counters of the torch.compile backend (torchneuron.compile_stats()["dynamo"])."""

from __future__ import annotations

import threading
from collections import Counter

_counts: Counter = Counter()
_lock = threading.Lock()


def add(name: str, n: int = 1) -> None:
    with _lock:
        _counts[name] += n


def snapshot() -> dict:
    with _lock:
        return dict(_counts)


def reset() -> None:
    with _lock:
        _counts.clear()
