"""Profiles as Parquet tables (pyarrow), for people and for tools (pandas, DuckDB).

`export_parquet(prof, directory)` writes, from a finished
`torch.profiler.profile` with `ProfilerActivity.PrivateUse1`:

- `events.parquet`: one row per event. `kind`: cpu_op, launch (an executable
  on the device), transfer, host op (an op run on the host path), compile,
  synchronize. `name`, `start_ns` (unix epoch), `duration_ns`, `device`,
  `stream` (negative for host rows: -1 compiles, -2 host path, -3 transfers,
  -4 synchronize), `correlation` (links a launch to the CPU op that issued it),
  `source` ("file:line" of the user's code), `details` (JSON: the launch's
  shapes, a fused graph's ops and their lines, a host op's reason, a
  compile's cache layer and key), `input_shapes` (CPU ops, with
  record_shapes).
- `ops.parquet`: per op name: launches, device_ns, host_ops, host_ns, transfers.
- `lines.parquet`: per source line: launches, device_ns, host_ops, host_ns, ops.
- `compiles.parquet`: per compile: what, layer (compiled, disk, remote,
  service, peer; "running at stop" for one the session ended during, its
  seconds then counted up to the stop), key, seconds, start_ns.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict

from ..runtime.errors import is_library_file
from . import recorder

_KINDS = {recorder.LAUNCH: "launch", recorder.COPY: "transfer"}


def _trace_start_ns(prof) -> int:
    try:
        return int(prof.profiler.kineto_results.trace_start_ns())
    except Exception:  # noqa: BLE001 - no kineto results: CPU rows keep relative times
        return 0


def event_rows(prof) -> list:
    """Every event of the profile as a dict (the events table's rows)."""
    import torch

    base = _trace_start_ns(prof)
    rows = []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CPU:
            continue  # device events come from the recorder, with their details
        rows.append({
            "kind": "cpu_op", "name": e.name, "start_ns": base + int(e.time_range.start * 1000),
            "duration_ns": int(e.time_range.elapsed_us() * 1000), "device": None, "stream": None,
            "correlation": int(e.id), "source": _user_frame(e.stack), "details": None,
            "input_shapes": json.dumps(e.input_shapes) if e.input_shapes else None,
        })
    for kind, name, start, end, device, stream, correlation, details, _ in recorder.last_events:
        if kind == recorder.CALL:
            continue  # the host side of a launch: its CPU op's row has that time
        rows.append({
            "kind": _KINDS.get(kind) or details.get("kind", "runtime"), "name": name, "start_ns": int(start),
            "duration_ns": int(max(end - start, 0)), "device": int(device), "stream": int(stream),
            "correlation": int(correlation), "source": details.get("source"),
            "details": json.dumps({k: v for k, v in details.items() if k not in ("source", "kind")}),
            "input_shapes": None,
        })
    rows.sort(key=lambda r: r["start_ns"])
    return rows


def _user_frame(stack) -> str | None:
    """The innermost frame of a CPU op's stack (with_stack) outside torch."""
    for frame in stack or ():
        path = frame.split("(", 1)[0]
        if not is_library_file(os.path.abspath(path)):
            line = frame.split("(", 1)[1].split(")", 1)[0] if "(" in frame else ""
            return f"{path}:{line}" if line else path
    return None


def summaries(rows) -> dict:
    """The ops, lines and compiles tables' rows."""
    ops = defaultdict(lambda: {"launches": 0, "device_ns": 0, "host_ops": 0, "host_ns": 0, "transfers": 0})
    lines = defaultdict(lambda: {"launches": 0, "device_ns": 0, "host_ops": 0, "host_ns": 0, "ops": set()})
    compiles = []
    for r in rows:
        kind = r["kind"]
        if kind == "compile":
            d = json.loads(r["details"])
            running = "running_at_stop" in d
            compiles.append({"what": r["name"].removeprefix("compile: "),
                             "layer": "running at stop" if running else d.get("layer"), "key": d.get("key"),
                             "seconds": r["duration_ns"] / 1e9 if running else float(d.get("compile_seconds", 0.0)),
                             "start_ns": r["start_ns"]})
            continue
        if kind == "launch":
            members = json.loads(r["details"]).get("ops")
            names = [m.split(" at ", 1) for m in members.split("; ")] if members else [(r["name"], r["source"])]
            # A fused graph's time, shared among its ops (the remainder to the first, so totals add up).
            share, rest = divmod(r["duration_ns"], max(len(names), 1))
            for k, (name, line) in enumerate(names):
                ops[name]["launches"] += 1
                ops[name]["device_ns"] += share + (rest if k == 0 else 0)
                lines[line]["launches"] += 1
                lines[line]["device_ns"] += share + (rest if k == 0 else 0)
                lines[line]["ops"].add(name)
        elif kind == "host op":
            name = r["name"].removeprefix("host op: ")
            ops[name]["host_ops"] += 1
            ops[name]["host_ns"] += r["duration_ns"]
            lines[r["source"]]["host_ops"] += 1
            lines[r["source"]]["host_ns"] += r["duration_ns"]
            lines[r["source"]]["ops"].add(name)
        elif kind == "transfer":
            ops[r["name"].removeprefix("transfer: ")]["transfers"] += 1
    return {
        "ops": [{"op": k, **v} for k, v in sorted(ops.items(), key=lambda kv: -(kv[1]["device_ns"] + kv[1]["host_ns"]))],
        "lines": [{"source": k, **dict(v, ops=", ".join(sorted(v["ops"])))}
                  for k, v in sorted(lines.items(), key=lambda kv: -(kv[1]["device_ns"] + kv[1]["host_ns"]))],
        "compiles": compiles,
    }


def export_parquet(prof, directory: str) -> dict:
    """Write the four tables into `directory`; returns {table: path}."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(directory, exist_ok=True)
    rows = event_rows(prof)
    tables = {"events": rows, **summaries(rows)}
    schemas = {
        "events": pa.schema([("kind", pa.string()), ("name", pa.string()), ("start_ns", pa.int64()),
                             ("duration_ns", pa.int64()), ("device", pa.int64()), ("stream", pa.int64()),
                             ("correlation", pa.int64()), ("source", pa.string()), ("details", pa.string()),
                             ("input_shapes", pa.string())]),
        "ops": pa.schema([("op", pa.string()), ("launches", pa.int64()), ("device_ns", pa.int64()),
                          ("host_ops", pa.int64()), ("host_ns", pa.int64()), ("transfers", pa.int64())]),
        "lines": pa.schema([("source", pa.string()), ("launches", pa.int64()), ("device_ns", pa.int64()),
                            ("host_ops", pa.int64()), ("host_ns", pa.int64()), ("ops", pa.string())]),
        "compiles": pa.schema([("what", pa.string()), ("layer", pa.string()), ("key", pa.string()),
                               ("seconds", pa.float64()), ("start_ns", pa.int64())]),
    }
    paths = {}
    for name, data in tables.items():
        path = os.path.join(directory, f"{name}.parquet")
        pq.write_table(pa.Table.from_pylist(data, schema=schemas[name]), path)
        paths[name] = path
    return paths
