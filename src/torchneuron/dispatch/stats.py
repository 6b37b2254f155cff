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
host_while_compiling: Counter = Counter()  # ops run on the host while their executable was built
fallback_reasons: dict = {}  # op -> why it could not be compiled (first reason seen)
# Op plans built in the background (the program went on) or in line (it
# waited: TORCHNEURON_COMPILE_WAIT=1, fallback policy "error"), and the
# seconds it waited for them.
builds = {"background": 0, "in_line": 0, "seconds_waited": 0.0}


def add_build(kind: str, seconds: float = 0.0) -> None:
    with _lock:
        builds[kind] += 1
        builds["seconds_waited"] += seconds


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
            "ops_on_host_while_compiling": sum(host_while_compiling.values()),
            "op_builds_in_background": builds["background"],
            "op_builds_in_line": builds["in_line"],
            "op_compile_seconds_waited": round(builds["seconds_waited"], 3),
        }


def reset() -> None:
    with _lock:
        dispatched.clear()
        host_fallback.clear()
        compiled.clear()
        transfers.clear()
        decomposed.clear()
        host_while_compiling.clear()
        builds.update(background=0, in_line=0, seconds_waited=0.0)
