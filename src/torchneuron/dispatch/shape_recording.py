"""Recording op signatures as a program runs: the half of the shape registry
that sits on the dispatch path (eval/registry.py merges, samples and
exports what it records).

With recording on (`TORCHNEURON_RECORD_SHAPES=PATH`, or `record_shapes(PATH)`)
each op call that reaches the dispatch entry point is described as canonical
JSON (op overload; each tensor's dtype, sizes, strides, storage offset and,
for integer and bool tensors, the range of its values; scalars and constants)
and counted per model. Counts are kept in memory and merged into an SQLite
database when recording stops, so runs (and processes) accumulate.

The entry point reads `_recorder` (and csrc/recording.cpp this module's
globals) on every call: None unless a recording is on.
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


def _tensor(t: torch.Tensor, written: bool = False) -> dict:
    d = {"T": _dtype_name(t.dtype), "size": list(t.shape), "stride": list(t.stride()),
         "offset": t.storage_offset(), "dev": t.device.type}
    # The values of a tensor the op writes may be uninitialized memory (a
    # copy_ into torch.empty): a range of them would make signatures differ
    # from run to run.
    if (not t.dtype.is_floating_point and not t.dtype.is_complex) and t.numel() and not written:
        d["range"] = _value_range(t)
    return d


def _value_range(t: torch.Tensor) -> list:
    """[min, max] of an integer or bool tensor: generated inputs stay valid
    indices. Reads the values through a host alias (no neuron op)."""
    if t.device.type == "neuron":
        from ..runtime import transfers

        torch.neuron.synchronize(t.device.index)
        t = transfers.to_host(t)
    if t.dtype == torch.bool:
        return [int(t.all()), int(t.any())]
    return [int(t.min()), int(t.max())]


def encode(value, written: bool = False):
    """A JSON-able description of one argument (`written`: the op writes it)."""
    if isinstance(value, torch.Tensor):
        return _tensor(value, written)
    if isinstance(value, bool) or value is None or isinstance(value, int):
        return value
    if isinstance(value, float):
        return {"f": repr(value)}
    if isinstance(value, str):
        return {"s": value}
    if isinstance(value, list):
        return {"L": [encode(v, written) for v in value]}
    if isinstance(value, tuple):
        return {"U": [encode(v, written) for v in value]}
    if isinstance(value, torch.dtype):
        return {"dtype": _dtype_name(value)}
    if isinstance(value, torch.device):
        return {"device": value.type}
    if isinstance(value, torch.layout):
        return {"layout": str(value).replace("torch.", "")}
    if isinstance(value, torch.memory_format):
        return {"mf": str(value).replace("torch.", "")}
    return {"other": type(value).__name__}


def signature_text(args, kwargs, written=frozenset()) -> str:
    """`written`: positions and names of the arguments the op writes."""
    return json.dumps({"args": [encode(a, i in written) for i, a in enumerate(args)],
                       "kwargs": {k: encode(v, k in written) for k, v in kwargs.items()}},
                      sort_keys=True, separators=(",", ":"))


_written_cache: dict = {}


def written_arguments(op_name: str) -> frozenset:
    """Positions and names of the arguments an op writes ("aten.copy_.default": {0, "self"})."""
    found = _written_cache.get(op_name)
    if found is None:
        found = frozenset()
        try:
            ns, name, overload = op_name.split(".", 2)
            schema = getattr(getattr(getattr(torch.ops, ns), name), overload)._schema
            found = frozenset(x for i, a in enumerate(schema.arguments)
                              if a.alias_info is not None and a.alias_info.is_write for x in (i, a.name))
        except (AttributeError, ValueError):
            pass
        _written_cache[op_name] = found
    return found


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
            key = (op_name, signature_text(args, kwargs, written_arguments(op_name)), self.model)
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


# -- turning recording on and off ----------------------------------------------

_recorder: Recorder | None = None


def active() -> Recorder | None:
    return _recorder


def set_active(recorder: Recorder | None) -> None:
    """Record into `recorder` from now on (None: stop), without flushing:
    the census counts each model's signatures itself."""
    global _recorder
    _recorder = recorder


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
