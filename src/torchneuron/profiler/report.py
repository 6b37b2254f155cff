"""`torchneuron profile SCRIPT [args]`: run a script under torch.profiler and
say where its time went.

The report splits the profiled wall time into device execution (the union of
launch intervals: time the device was busy), host-path ops, transfers, waits
for the device, compiles (in the background unless the program waited), and
idle device time; lists the source lines and ops with the most device and
host time; and gives hints a person can act on. `--html` writes a timeline
(one row per stream and host row) with the tables; a PNG of the split is
written beside it. `--parquet DIR` writes the tables (export.py).
"""

from __future__ import annotations

import html
import json
import os
import runpy
import sys

from .export import event_rows, summaries

_HOST_KINDS = ("host op", "transfer", "synchronize", "compile")


def run_script(path: str, argv: list):
    """Run `path` as __main__ with `argv` under the profiler; the finished profile."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    saved = sys.argv
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1], record_shapes=True) as prof:
            try:
                runpy.run_path(path, run_name="__main__")
            except SystemExit as e:
                if e.code not in (None, 0):
                    raise
            torch.neuron.synchronize()
    finally:
        sys.argv = saved
        sys.path.pop(0)
    return prof


def _shown(source) -> str:
    """A source line as a person reads it: relative to the working directory when under it."""
    if not source:
        return "<unknown>"
    path = str(source)
    try:
        relative = os.path.relpath(path)
    except ValueError:
        return path
    return path if relative.startswith("..") else relative


def _union_ns(intervals) -> int:
    total, end = 0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def split(rows) -> dict:
    """Seconds of the profiled wall time: device busy, host path, transfers,
    waits, compiles (wall time compiling, mostly in the background), idle."""
    if not rows:
        return {}
    wall_start = min(r["start_ns"] for r in rows)
    wall_end = max(r["start_ns"] + r["duration_ns"] for r in rows)
    wall = max(wall_end - wall_start, 1)
    launches = [(r["start_ns"], r["start_ns"] + r["duration_ns"]) for r in rows if r["kind"] == "launch"]
    busy = _union_ns(launches)

    def total(*kinds):
        return _union_ns([(r["start_ns"], r["start_ns"] + r["duration_ns"]) for r in rows if r["kind"] in kinds])

    return {
        "wall": wall / 1e9, "device": busy / 1e9, "host op": total("host op") / 1e9,
        "transfer": total("transfer") / 1e9, "synchronize": total("synchronize") / 1e9,
        "compile": total("compile", "lower") / 1e9, "idle": (wall - busy) / 1e9,
    }


def hints(rows, tables, parts) -> list:
    out = []
    wall = parts.get("wall", 0) or 1
    work = (parts.get("device", 0) + parts.get("host op", 0) + parts.get("transfer", 0)) or 1
    for line in tables["lines"][:10]:
        share = line["host_ns"] / 1e9 / work
        if share >= 0.05:
            ops = [r for r in rows if r["kind"] == "host op" and r["source"] == line["source"]]
            reasons = {json.loads(r["details"]).get("reason", "") for r in ops}
            by_op: dict = {}
            for r in ops:
                name = r["name"].removeprefix("host op: ")
                by_op[name] = by_op.get(name, 0) + r["duration_ns"]
            names = ", ".join(sorted(by_op, key=lambda k: -by_op[k])[:4]) + (" and others" if len(by_op) > 4 else "")
            out.append(f"{_shown(line['source'])}: {share:.0%} of the device and host-path time is on the host path, for {names} "
                       f"({'; '.join(sorted(reasons))[:200]})")
    compiled = [c for c in tables["compiles"] if c["layer"] == "compiled"]
    if compiled and parts.get("compile", 0) / wall >= 0.2:
        out.append(f"{len(compiled)} executables were compiled ({sum(c['seconds'] for c in compiled):.1f} s of "
                   "compiler time): a second run reads them from the disk cache (`torchneuron cache stats`)")
    if parts.get("idle", 0) / wall >= 0.5 and parts.get("device", 0) > 0:
        out.append(f"the device is idle {parts['idle'] / wall:.0%} of the time: Python between launches dominates; "
                   "adaptive eager (TORCHNEURON_EAGER_MODE=adaptive) or torch.compile(backend=\"neuron\") fuse ops")
    waits = [r for r in rows if r["kind"] == "synchronize"]
    if waits and parts.get("synchronize", 0) / wall >= 0.1:
        by_line: dict = {}
        for r in waits:
            by_line[r["source"]] = by_line.get(r["source"], 0) + 1
        line, n = max(by_line.items(), key=lambda kv: kv[1])
        out.append(f"{_shown(line)}: the host waits for the device {n} times ({parts['synchronize'] / wall:.0%} of the "
                   "time); a read such as .item() or .cpu() there ends the overlap of host and device")
    return out


def text_report(prof, top: int = 10) -> str:
    rows = event_rows(prof)
    tables = summaries(rows)
    parts = split(rows)
    if not parts:
        return "no events recorded"
    wall = parts["wall"]
    out = [f"profiled {wall:.3f} s", "", "where the time went (share of the profiled wall time):"]
    for name, label in (("device", "device executing"), ("host op", "ops on the host path"),
                        ("transfer", "transfers host <-> device"), ("synchronize", "host waiting for the device"),
                        ("compile", "building: lowering, compiling (background)"), ("idle", "device idle")):
        out.append(f"  {label:<42} {parts[name]:9.4f} s  {parts[name] / wall:6.1%}")
    out += ["", "top source lines (device + host-path time):",
            f"  {'device ms':>10} {'host ms':>10} {'launches':>9}  line: ops"]
    for r in tables["lines"][:top]:
        out.append(f"  {r['device_ns'] / 1e6:10.3f} {r['host_ns'] / 1e6:10.3f} {r['launches']:9d}  "
                   f"{_shown(r['source'])}: {r['ops'][:120]}")
    out += ["", "top ops:", f"  {'op':<44} {'device ms':>10} {'launches':>9} {'host ms':>10} {'host ops':>9}"]
    for r in tables["ops"][:top]:
        out.append(f"  {r['op'][:44]:<44} {r['device_ns'] / 1e6:10.3f} {r['launches']:9d} {r['host_ns'] / 1e6:10.3f} "
                   f"{r['host_ops']:9d}")
    found = hints(rows, tables, parts)
    if found:
        out += ["", "hints:"] + [f"  - {h}" for h in found]
    return "\n".join(out)


_ROW_NAMES = {-1: "compiles", -2: "host path", -3: "transfers", -4: "synchronize"}


def write_html(prof, path: str) -> list:
    """A timeline (SVG) with the report; and a PNG of the split beside it.
    Returns the paths written."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    rows = [r for r in event_rows(prof) if r["kind"] != "cpu_op"]
    report = text_report(prof)
    written = [path]
    start = min((r["start_ns"] for r in rows), default=0)
    end = max((r["start_ns"] + r["duration_ns"] for r in rows), default=1)
    span = max(end - start, 1)
    lanes = sorted({(r["device"], r["stream"]) for r in rows}, key=lambda k: (k[1] < 0, k))
    width, lane_h = 1400, 22
    colors = {"launch": "#3b7dd8", "host op": "#d8643b", "transfer": "#7a4fd0", "synchronize": "#999999",
              "compile": "#3bb273", "lower": "#9ad9a6"}
    shapes = []
    for y, lane in enumerate(lanes):
        label = _ROW_NAMES.get(lane[1], f"neuron:{lane[0]} stream {lane[1]}")
        shapes.append(f'<text x="4" y="{y * lane_h + 15}" font-size="12">{html.escape(label)}</text>')
        for r in rows:
            if (r["device"], r["stream"]) != lane:
                continue
            x = 160 + (r["start_ns"] - start) / span * (width - 170)
            w = max(r["duration_ns"] / span * (width - 170), 0.5)
            tip = html.escape(f"{r['name']} {r['duration_ns'] / 1e3:.1f} us {r['source'] or ''} {r['details'] or ''}")
            shapes.append(f'<rect x="{x:.2f}" y="{y * lane_h + 3}" width="{w:.2f}" height="{lane_h - 6}" '
                          f'fill="{colors.get(r["kind"], "#444")}"><title>{tip}</title></rect>')
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{len(lanes) * lane_h + 10}">'
           + "".join(shapes) + "</svg>")
    png = os.path.splitext(path)[0] + ".png"
    written.append(_plot(rows, lanes, split(event_rows(prof)), png, colors))
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>torchneuron profile</title></head><body>"
            f"<h2>torchneuron profile</h2><p>Hover a bar for its op, duration, source line and details.</p>{svg}"
            f"<p><img src='{html.escape(os.path.basename(png))}'></p><pre>{html.escape(report)}</pre></body></html>")
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)
    return written


def _plot(rows, lanes, parts: dict, path: str, colors: dict) -> str:
    """The timeline (one row per stream and host row) above the split of the wall time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (timeline, bars) = plt.subplots(2, 1, figsize=(11, 2.2 + 0.32 * len(lanes) + 2.4),
                                         gridspec_kw={"height_ratios": [max(len(lanes), 1) * 0.32 + 0.8, 2.4]})
    start = min((r["start_ns"] for r in rows), default=0)
    for y, lane in enumerate(lanes):
        spans = {}
        for r in rows:
            if (r["device"], r["stream"]) == lane:
                spans.setdefault(r["kind"], []).append(((r["start_ns"] - start) / 1e9, max(r["duration_ns"], 1) / 1e9))
        for kind, xs in spans.items():
            timeline.broken_barh(xs, (y - 0.4, 0.8), color=colors.get(kind, "#444"))
    timeline.set_yticks(range(len(lanes)))
    timeline.set_yticklabels([_ROW_NAMES.get(lane[1], f"neuron:{lane[0]} stream {lane[1]}") for lane in lanes])
    timeline.invert_yaxis()
    timeline.set_xlabel("seconds since the first event")
    timeline.set_title("timeline")
    names = ["device", "host op", "transfer", "synchronize", "compile", "idle"]
    bars.barh(names, [parts.get(n, 0.0) for n in names], color=["#3b7dd8", "#d8643b", "#7a4fd0", "#999999",
                                                               "#3bb273", "#dddddd"])
    bars.set_xlabel("seconds")
    bars.set_title(f"where {parts.get('wall', 0.0):.3f} s went")
    bars.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def save(prof, directory: str, top: int = 10) -> dict:
    """Everything about a finished profile in `directory`: the Chrome trace
    (trace.json), the Parquet tables (parquet/), the report (report.txt) and
    the timeline (timeline.html, timeline.png). Returns {what: path}."""
    from .export import export_parquet

    os.makedirs(directory, exist_ok=True)
    written = {"trace": os.path.join(directory, "trace.json"), "report": os.path.join(directory, "report.txt")}
    prof.export_chrome_trace(written["trace"])
    with open(written["report"], "w", encoding="utf-8") as f:
        f.write(text_report(prof, top=top) + "\n")
    written["timeline"], written["plot"] = write_html(prof, os.path.join(directory, "timeline.html"))
    written.update(export_parquet(prof, os.path.join(directory, "parquet")))
    return written


def main(args) -> int:
    from .export import export_parquet

    prof = run_script(args.script, args.args)
    print(text_report(prof, top=args.top))
    if args.html:
        for written in write_html(prof, args.html):
            print(f"wrote {written}")
    if args.parquet:
        for name, written in export_parquet(prof, args.parquet).items():
            print(f"wrote {written}")
    return 0
