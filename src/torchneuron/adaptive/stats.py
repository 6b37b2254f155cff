"""What adaptive eager did: graphs, cuts, launches by tier, compile time hidden."""

from __future__ import annotations

import threading
from collections import Counter

_lock = threading.Lock()
ops_recorded = 0
graphs_cut = 0
cut_reasons: Counter = Counter()  # why graphs were cut
launches: Counter = Counter()  # graphs run by tier: fused, op (per-op executables and host), host ops
op_tier_ops: Counter = Counter()  # ops of unfused graphs: "compiled" (per-op executable) or "host"
graphs_compiled = 0  # fused executables built (compiled or fetched from a cache layer)
graphs_segmented = 0  # graphs that compiled only in parts (segments around what does not fuse)
graphs_failed = 0  # fused graphs that could not be built: their ops run one by one
compile_seconds_hidden = 0.0  # background lowering + compiling while the program ran on
compile_seconds_exposed = 0.0  # time the program waited for a fused build (TORCHNEURON_COMPILE_WAIT)
bytes_not_written = 0  # results of fused graphs nobody could read, so never written
ops_fused = 0  # ops run inside fused executables
largest_graph = 0


def add(name: str, value) -> None:
    global ops_recorded, graphs_cut, graphs_compiled, graphs_failed, compile_seconds_hidden
    global compile_seconds_exposed, bytes_not_written, ops_fused
    with _lock:
        globals()[name] += value


def snapshot() -> dict:
    with _lock:
        return {
            "ops_recorded": ops_recorded,
            "graphs_cut": graphs_cut,
            "ops_per_graph": round(ops_recorded / graphs_cut, 1) if graphs_cut else 0.0,
            "largest_graph": largest_graph,
            "cut_reasons": dict(cut_reasons),
            "launches": dict(launches),
            "ops_fused": ops_fused,
            "op_tier_ops": dict(op_tier_ops),
            "graphs_compiled": graphs_compiled,
            "graphs_segmented": graphs_segmented,
            "graphs_failed": graphs_failed,
            "compile_seconds_hidden": round(compile_seconds_hidden, 3),
            "compile_seconds_exposed": round(compile_seconds_exposed, 3),
            "bytes_not_written": bytes_not_written,
        }


def reset() -> None:
    global ops_recorded, graphs_cut, graphs_compiled, graphs_failed, compile_seconds_hidden
    global compile_seconds_exposed, bytes_not_written, ops_fused, largest_graph, graphs_segmented
    with _lock:
        ops_recorded = graphs_cut = graphs_compiled = graphs_failed = bytes_not_written = ops_fused = 0
        graphs_segmented = 0
        largest_graph = 0
        compile_seconds_hidden = compile_seconds_exposed = 0.0
        cut_reasons.clear()
        launches.clear()
        op_tier_ops.clear()
