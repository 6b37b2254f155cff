"""Counts of the ops dispatched to neuron, by op and by how they ran."""

from __future__ import annotations

import threading
from collections import Counter

_lock = threading.Lock()
dispatched: Counter = Counter()  # every op that reached the entry point
host_fallback: Counter = Counter()  # ops that ran on the host fallback
compiled: Counter = Counter()  # ops that ran as compiled executables
transfers: Counter = Counter()  # host reads and copies between host and device
decomposed: Counter = Counter()  # ops not compiled whole, run as PyTorch's generic decomposition
fallback_reasons: dict = {}  # op -> why it could not be compiled (first reason seen)


def record(counter: Counter, name: str) -> None:
    # On the per-op hot path: a lost increment under free threading would
    # only skew a statistic, so no lock.
    counter[name] += 1


def snapshot() -> dict:
    with _lock:
        return {
            "ops_dispatched": sum(dispatched.values()),
            "ops_compiled": sum(compiled.values()),
            "ops_on_host_fallback": sum(host_fallback.values()),
            "transfers": sum(transfers.values()),
            "distinct_ops": len(dispatched),
            "distinct_fallback_ops": len(host_fallback),
        }


def reset() -> None:
    with _lock:
        dispatched.clear()
        host_fallback.clear()
        compiled.clear()
        transfers.clear()
        decomposed.clear()
