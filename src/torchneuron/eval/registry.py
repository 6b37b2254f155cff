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
        from .. import _C

        torch.neuron.synchronize(t.device.index)
        t = _C.host_alias(t)
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


def replace_models(out: str, sources: list) -> int:
    """Merge the source registries into out, first dropping out's rows of every
    model the sources hold (a model run again replaces its signatures). A
    `.parquet` out is read and written as Parquet. Returns signatures merged."""
    counts: dict = {}
    for src in sources:
        counts.update({(op, sig, model): n for op, sig, n, model in _all_rows(src)})
    models = {model for _, _, model in counts}
    kept = {(op, sig, model): n for op, sig, n, model in (_all_rows(out) if os.path.exists(out) else [])
            if model not in models}
    kept.update(counts)
    if out.endswith(".parquet"):
        _write_parquet(out, kept)
    else:
        if os.path.exists(out):
            os.remove(out)
        merge_counts(out, kept)
    return len(counts)


def _all_rows(path: str) -> list:
    """[(op, sig, count, model)], one per (signature, model)."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        table = pq.read_table(path).to_pydict()
        return list(zip(table["op"], table["sig"], table["count"], table["model"]))
    db = connect(path)
    try:
        return db.execute("SELECT op, sig, count, model FROM signatures").fetchall()
    finally:
        db.close()


def _write_parquet(path: str, counts: dict) -> None:
    """Sorted and dictionary-encoded: the same signature text under many
    models is stored once, so the census's registry fits in the repository."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    items = sorted(counts.items())
    table = pa.table({
        "op": [op for (op, _, _), _ in items],
        "sig": [sig for (_, sig, _), _ in items],
        "model": [model for (_, _, model), _ in items],
        "count": pa.array([n for _, n in items], pa.int64()),
    })
    tmp = path + ".tmp"
    pq.write_table(table, tmp, compression="zstd", compression_level=19, use_dictionary=True)
    os.replace(tmp, path)


def rows(path: str, ops=None) -> list:
    """[(op, sig, total count, [models])] by op, then signature."""
    if path.endswith(".parquet"):
        grouped: dict = {}
        for op, sig, n, model in _all_rows(path):
            total, models = grouped.get((op, sig), (0, set()))
            models.add(model)
            grouped[(op, sig)] = (total + n, models)
        wanted = set(ops) if ops else None
        return [(op, sig, n, sorted(models)) for (op, sig), (n, models) in sorted(grouped.items())
                if wanted is None or op in wanted]
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


def sample(found: list, n: int) -> list:
    """At most n of the rows, spread over ops: every op's first signature,
    then every op's second, and so on (the same sample on every run)."""
    by_op: dict = {}
    for row in found:
        by_op.setdefault(row[0], []).append(row)
    picked: list = []
    depth = 0
    while len(picked) < n and any(depth < len(v) for v in by_op.values()):
        for op in sorted(by_op):
            if depth < len(by_op[op]) and len(picked) < n:
                picked.append(by_op[op][depth])
        depth += 1
    return sorted(picked, key=lambda r: (r[0], r[1]))


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
