"""Counts of the ops dispatched to neuron, by op and by how they ran."""

from __future__ import annotations

import threading
from collections import Counter

_lock = threading.Lock()
dispatched: Counter = Counter()  # every op that reached the entry point
host_fallback: Counter = Counter()  # ops that ran on the host fallback


def record(counter: Counter, name: str) -> None:
    with _lock:
        counter[name] += 1


def snapshot() -> dict:
    with _lock:
        return {
            "ops_dispatched": sum(dispatched.values()),
            "ops_on_host_fallback": sum(host_fallback.values()),
            "distinct_ops": len(dispatched),
            "distinct_fallback_ops": len(host_fallback),
        }


def reset() -> None:
    with _lock:
        dispatched.clear()
        host_fallback.clear()
