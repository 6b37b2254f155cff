"""The shape registry: every op signature that real runs dispatch to neuron,
counted per model in an SQLite database.

Recording is the dispatch layer's (dispatch/shape_recording.py, re-exported
here); this half merges registries, reads and samples their rows, and
exports them to Parquet.
"""

from __future__ import annotations

import json
import os

from ..dispatch.shape_recording import (  # noqa: F401 - the registry's whole API in one place
    Recorder,
    active,
    connect,
    encode,
    merge_counts,
    record_shapes,
    set_active,
    signature_text,
    start_from_environment,
    written_arguments,
)


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


