"""The shape registry: every op signature that real runs dispatch to neuron.

With recording on (`TORCHNEURON_RECORD_SHAPES=PATH`, or `record_shapes(PATH)`)
each op call that reaches the dispatch entry point is described as canonical
JSON (op overload; each tensor's dtype, sizes, strides, storage offset and,
for integer and bool tensors, the range of its values; scalars and constants)
and counted per model. Counts are kept in memory and merged into an SQLite
database when recording stops, so runs (and processes) accumulate.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sqlite3
import sys
import threading
import time

import torch

_SCHEMA = """
CREATE TABLE IF NOT EXISTS signatures (
    op TEXT NOT NULL, sig TEXT NOT NULL, model TEXT NOT NULL, count INTEGER NOT NULL,
    PRIMARY KEY (op, sig, model)
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _tensor(t: torch.Tensor) -> dict:
    d = {"T": _dtype_name(t.dtype), "size": list(t.shape), "stride": list(t.stride()),
         "offset": t.storage_offset(), "dev": t.device.type}
    if (not t.dtype.is_floating_point and not t.dtype.is_complex) and t.numel():
        d["range"] = _value_range(t)
    return d


def _value_range(t: torch.Tensor) -> list:
    """[min, max] of an integer or bool tensor: generated inputs stay valid
    indices. Reads the values through a host alias (no neuron op)."""
    if t.device.type == "neuron":
        from .. import _C

        torch.neuron.synchronize(t.device.index)
        t = _C.host_alias(t)
    if t.dtype == torch.bool:
        return [int(t.all()), int(t.any())]
    return [int(t.min()), int(t.max())]


def encode(value):
    """A JSON-able description of one argument."""
    if isinstance(value, torch.Tensor):
        return _tensor(value)
    if isinstance(value, bool) or value is None or isinstance(value, int):
        return value
    if isinstance(value, float):
        return {"f": repr(value)}
    if isinstance(value, str):
        return {"s": value}
    if isinstance(value, list):
        return {"L": [encode(v) for v in value]}
    if isinstance(value, tuple):
        return {"U": [encode(v) for v in value]}
    if isinstance(value, torch.dtype):
        return {"dtype": _dtype_name(value)}
    if isinstance(value, torch.device):
        return {"device": value.type}
    if isinstance(value, torch.layout):
        return {"layout": str(value).replace("torch.", "")}
    if isinstance(value, torch.memory_format):
        return {"mf": str(value).replace("torch.", "")}
    return {"other": type(value).__name__}


def signature_text(args, kwargs) -> str:
    return json.dumps({"args": [encode(a) for a in args], "kwargs": {k: encode(v) for k, v in kwargs.items()}},
                      sort_keys=True, separators=(",", ":"))


class Recorder:
    """Counts signatures in memory; `flush()` merges them into the database."""

    def __init__(self, path: str, model: str):
        self.path = path
        self.model = model
        self.counts: dict = {}
        self._lock = threading.Lock()
        self._busy = threading.local()

    def record(self, op_name: str, args, kwargs) -> None:
        if getattr(self._busy, "on", False):  # reading value ranges must not record itself
            return
        self._busy.on = True
        try:
            key = (op_name, signature_text(args, kwargs), self.model)
        finally:
            self._busy.on = False
        with self._lock:
            self.counts[key] = self.counts.get(key, 0) + 1

    def flush(self) -> int:
        with self._lock:
            counts, self.counts = self.counts, {}
        if counts:
            merge_counts(self.path, counts)
        return len(counts)


def connect(path: str) -> sqlite3.Connection:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    db = sqlite3.connect(path, timeout=60)
    db.executescript(_SCHEMA)
    return db


def merge_counts(path: str, counts: dict) -> None:
    db = connect(path)
    try:
        with db:
            db.executemany(
                "INSERT INTO signatures (op, sig, model, count) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (op, sig, model) DO UPDATE SET count = count + excluded.count",
                [(op, sig, model, n) for (op, sig, model), n in counts.items()],
            )
            db.execute("INSERT OR REPLACE INTO meta VALUES ('torch', ?)", (torch.__version__,))
            db.execute("INSERT OR REPLACE INTO meta VALUES ('updated', ?)", (time.strftime("%Y-%m-%d %H:%M:%S"),))
    finally:
        db.close()


def merge(out: str, sources: list) -> int:
    """Add the counts of every source registry into out; returns signatures merged."""
    n = 0
    for src in sources:
        db = connect(src)
        try:
            rows = db.execute("SELECT op, sig, model, count FROM signatures").fetchall()
        finally:
            db.close()
        merge_counts(out, {(op, sig, model): count for op, sig, model, count in rows})
        n += len(rows)
    return n


def rows(path: str, ops=None) -> list:
    """[(op, sig, total count, [models])] by op, then signature."""
    db = connect(path)
    try:
        found = db.execute(
            "SELECT op, sig, SUM(count), GROUP_CONCAT(model, '\x1f') FROM signatures GROUP BY op, sig ORDER BY op, sig"
        ).fetchall()
    finally:
        db.close()
    wanted = set(ops) if ops else None
    return [(op, sig, n, sorted(set(models.split("\x1f")))) for op, sig, n, models in found
            if wanted is None or op in wanted]


def stats(path: str) -> dict:
    found = rows(path)
    per_op: dict = {}
    models: set = set()
    for op, _, n, m in found:
        calls, sigs = per_op.get(op, (0, 0))
        per_op[op] = (calls + n, sigs + 1)
        models.update(m)
    top = sorted(per_op.items(), key=lambda kv: -kv[1][0])[:20]
    return {"signatures": len(found), "ops": len(per_op), "calls": sum(n for _, _, n, _ in found),
            "models": sorted(models), "top_ops": {op: {"calls": c, "signatures": s} for op, (c, s) in top}}


def export(path: str, out: str) -> int:
    """Write the registry as JSON lines (one signature per line)."""
    found = rows(path)
    with open(out, "w") as f:
        for op, sig, n, models in found:
            f.write(json.dumps({"op": op, "count": n, "models": models, **json.loads(sig)}) + "\n")
    return len(found)


# -- turning recording on and off ----------------------------------------------

_recorder: Recorder | None = None


def active() -> Recorder | None:
    return _recorder


def _default_model() -> str:
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "interactive"
    return os.environ.get("TORCHNEURON_RECORD_MODEL", name)


@contextlib.contextmanager
def record_shapes(path: str, model: str | None = None):
    """Record every op signature dispatched to neuron inside the block into
    the registry at path (merged with what it holds), attributed to model."""
    global _recorder
    torch.neuron.synchronize()
    previous = _recorder
    if previous is not None:
        previous.flush()
    _recorder = Recorder(path, model or _default_model())
    try:
        yield _recorder
    finally:
        recorder, _recorder = _recorder, previous
        recorder.flush()


def start_from_environment() -> None:
    """TORCHNEURON_RECORD_SHAPES=PATH: record the whole process."""
    global _recorder
    path = os.environ.get("TORCHNEURON_RECORD_SHAPES")
    if path and _recorder is None:
        _recorder = Recorder(path, _default_model())
        atexit.register(_recorder.flush)
