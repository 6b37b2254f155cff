"""Census reports: pass rates by feature class and mode, top failure causes,
what changed since the previous report, and the representative set."""

from __future__ import annotations

import json
import os
from collections import Counter, defaultdict

REPRESENTATIVE = os.path.join(os.path.dirname(__file__), "data", "representative.json")


def _feature_values(result: dict) -> list:
    out = []
    for key, value in (result.get("features") or {}).items():
        for v in (value if isinstance(value, list) else [value]):
            out.append(f"{key}={str(v).lower()}")
    return out


def _outcome(result: dict, mode: str, phase: str) -> str | None:
    entry = (result.get("modes") or {}).get(mode)
    if entry is None:
        return None
    return entry.get(phase)


def model_passes(result: dict, mode: str) -> bool:
    entry = (result.get("modes") or {}).get(mode) or {}
    return entry.get("forward") == "pass" and entry.get("backward", "pass") == "pass"


def summarize(results: dict, previous: dict | None = None) -> dict:
    ran = [dict(r, model=m) for m, r in results.items() if r.get("status") == "ran"]
    modes = sorted({m for r in ran for m in r.get("modes", {})})
    status = Counter(r.get("status") for r in results.values())
    summary = {
        "architectures": len(results),
        "built": status.get("ran", 0) + status.get("reference-error", 0),
        "status": dict(status),
        "modes": {},
        "features": {},
        "not_buildable": Counter(_cause(r.get("reason", "")) for r in results.values()
                                 if r.get("status") == "not-buildable").most_common(15),
    }
    for mode in modes:
        counts = {phase: Counter(_outcome(r, mode, phase) for r in ran if _outcome(r, mode, phase))
                  for phase in ("forward", "backward")}
        causes: dict = defaultdict(list)
        for r in ran:
            entry = r["modes"].get(mode, {})
            for phase in ("forward", "backward"):
                if entry.get(phase) in ("error", "mismatch"):
                    cause = _cause(entry.get(f"{phase}_cause") or entry.get("error")
                                   or entry.get(f"{phase}_detail") or entry.get(phase))
                    causes[f"{entry[phase]}: {cause}"].append(r["model"])
                    break
        summary["modes"][mode] = {
            "forward": dict(counts["forward"]), "backward": dict(counts["backward"]),
            "models_passing": sum(model_passes(r, mode) for r in ran),
            "top_causes": sorted(([c, len(m), sorted(set(m))[:5]] for c, m in causes.items()), key=lambda x: -x[1])[:15],
            # passes where neuron differed from CPU but was as close to the float64 answer
            "arbitrated": sorted(r["model"] for r in ran
                                 if any(f"{p}_arbitrated" in r["modes"].get(mode, {}) for p in ("forward", "backward"))),
        }
    by_feature: dict = defaultdict(lambda: defaultdict(int))
    for r in ran:
        for fv in _feature_values(r):
            by_feature[fv]["models"] += 1
            for mode in modes:
                by_feature[fv][f"{mode}_ran"] += mode in r.get("modes", {})
                by_feature[fv][f"{mode}_pass"] += model_passes(r, mode)
    summary["features"] = {k: dict(v) for k, v in sorted(by_feature.items())}
    summary["guarded"] = {}
    for mode in modes:
        guarded = [r for r in ran if r["modes"].get(mode, {}).get("check_memory")]
        if guarded:
            runs = [(r["model"], run) for r in guarded
                    for run in (r["modes"][mode], r["modes"][mode].get("with_others")) if run]
            summary["guarded"][mode] = {
                "models": len(guarded),
                "several_per_process": sum(len(run.get("models_in_process", [])) > 1 for _, run in runs),
                "violations": sorted({m for m, run in runs if "NeuronMemoryError" in str(run.get("error", ""))}),
                "crashes": sorted({m for m, run in runs if run.get("crashed")}),
                "passing": sum(run.get("forward") == "pass" and run.get("backward", "pass") == "pass"
                               for _, run in runs),
                "runs": len(runs),
            }
    if previous:
        summary["changes"] = _changes(results, previous, modes)
    return summary


def _cause(text: str) -> str:
    text = (text or "").strip()
    for sep in (" at ", "(", "\n"):
        if sep in text[40:]:
            text = text[: 40 + text[40:].index(sep)]
    return text[:110]


def _changes(results: dict, previous: dict, modes: list) -> dict:
    out = {}
    for mode in modes:
        newly, regressed = [], []
        for model, r in results.items():
            before = previous.get(model)
            if before is None or mode not in (before.get("modes") or {}) or mode not in (r.get("modes") or {}):
                continue
            was, now = model_passes(before, mode), model_passes(r, mode)
            if now and not was:
                newly.append(model)
            elif was and not now:
                regressed.append(model)
        out[mode] = {"newly_passing": sorted(newly), "regressed": sorted(regressed)}
    return out


def select_representative(results: dict, max_models: int = 60) -> dict:
    """Greedy set cover of feature values and op names by models that run."""
    ran = {m: r for m, r in results.items() if r.get("status") == "ran"}
    elements = {m: set(_feature_values(r)) | {f"op={op}" for op in r.get("ops", [])} for m, r in ran.items()}
    all_ops = {e for s in elements.values() for e in s if e.startswith("op=")}
    uncovered = set().union(*elements.values()) if elements else set()
    chosen = []
    while uncovered and len(chosen) < max_models:
        best = max(elements, key=lambda m: (len(elements[m] & uncovered), -ran[m].get("parameters", 0)))
        gain = elements[best] & uncovered
        if not gain:
            break
        chosen.append(best)
        uncovered -= gain
    covered_ops = {e for m in chosen for e in elements[m] if e.startswith("op=")}
    return {
        "models": chosen,
        "op_coverage": round(len(covered_ops) / len(all_ops), 4) if all_ops else 0.0,
        "ops_covered": len(covered_ops), "ops_total": len(all_ops),
        "features_uncovered": sorted(e for e in uncovered if not e.startswith("op=")),
    }


def write_markdown(path: str, summary: dict, representative: dict, command: str) -> None:
    lines = [
        "# Model census",
        "",
        "Every architecture in Hugging Face Transformers, built offline from a tiny random configuration, "
        "run forward (and backward where it trains) on neuron and on CPU, compared with rtol = 1e-3 and atol = 1e-3 times the tensor's largest value (at least 1e-3). "
        "`reference-error`: the generic tiny inputs or configuration make the model fail on CPU too "
        "(not a backend result). Modes: `host` runs every op on the host fallback, `compile` compiles "
        "every op (the default execution mode).",
        "",
        f"Command: `{command}`",
        "",
        f"- Architectures enumerated: {summary['architectures']}; built: **{summary['built']}**",
        "- Status: " + ", ".join(f"{k} {v}" for k, v in sorted(summary["status"].items())),
        f"- Representative set: {len(representative['models'])} models covering "
        f"{100 * representative['op_coverage']:.1f}% of the {representative['ops_total']} op names recorded",
        "",
        "## By mode",
        "",
        "| mode | forward pass | forward mismatch | forward error | backward pass | backward mismatch | "
        "backward error | models passing both |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, m in summary["modes"].items():
        f, b = m["forward"], m["backward"]
        lines.append(f"| {mode} | {f.get('pass', 0)} | {f.get('mismatch', 0)} | {f.get('error', 0)} | "
                     f"{b.get('pass', 0)} | {b.get('mismatch', 0)} | {b.get('error', 0)} | {m['models_passing']} |")
    for mode, m in summary["modes"].items():
        if m.get("arbitrated"):
            lines += ["", f"{mode}: {len(m['arbitrated'])} of these passes differ from CPU's float32 beyond the "
                      "tolerance but are as close to the float64 answer as CPU's (the unit stage's rule; each "
                      "result's `*_arbitrated` says by how much): " + ", ".join(m["arbitrated"]) + "."]
    modes = list(summary["modes"])
    lines += ["", "## By feature", "", "Passing forward and backward, of the models run in each mode.", "",
              "| feature | models | " + " | ".join(f"{m} pass / run" for m in modes) + " |",
              "|---|---:|" + "---:|" * len(modes)]
    for fv, d in summary["features"].items():
        cells = " | ".join(
            f"{d.get(f'{m}_pass', 0)} / {d.get(f'{m}_ran', 0)}"
            + (f" ({100 * d.get(f'{m}_pass', 0) / d[f'{m}_ran']:.0f}%)" if d.get(f"{m}_ran") else "")
            for m in modes)
        lines.append(f"| {fv} | {d['models']} | {cells} |")
    for mode, m in summary["modes"].items():
        lines += ["", f"## Top failure causes ({mode})", "", "| cause | models | examples |", "|---|---:|---|"]
        for cause, n, examples in m["top_causes"]:
            lines.append(f"| {cause.replace('|', '/')} | {n} | {', '.join(examples)} |")
    for mode, g in summary.get("guarded", {}).items():
        lines += ["", f"## Guarded memory ({mode})", "",
                  f"{g['models']} models ran in {mode} mode under `TORCHNEURON_CHECK_MEMORY=1` (guard bytes around "
                  "every device allocation, poisoned frees, checked after every launch), "
                  f"and {g['several_per_process']} of them again, several models one after another in one "
                  f"process; {g['passing']} of these {g['runs']} runs matched CPU forward and backward. "
                  f"Guard violations: {len(g['violations'])}"
                  + (f" ({', '.join(g['violations'])})" if g["violations"] else "")
                  + f"; crashed or hung workers: {len(g['crashes'])}"
                  + (f" ({', '.join(g['crashes'])})." if g["crashes"] else ".")]
    lines += ["", "## Not buildable (top reasons)", "", "| reason | models |", "|---|---:|"]
    for reason, n in summary["not_buildable"]:
        lines.append(f"| {reason.replace('|', '/')} | {n} |")
    if summary.get("changes"):
        lines += ["", "## Since the previous report", ""]
        for mode, c in summary["changes"].items():
            lines.append(f"- {mode}: newly passing {len(c['newly_passing'])} "
                         f"({', '.join(c['newly_passing'][:10])}); regressed {len(c['regressed'])} "
                         f"({', '.join(c['regressed'][:10])})")
    lines += ["", "## Representative set", "", ", ".join(representative["models"]), ""]
    if representative["features_uncovered"]:
        lines.append("Feature values no runnable model covers: " + ", ".join(representative["features_uncovered"]))
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def merge_mode_results(base_path: str, run_path: str, out_path: str, guarded: bool = False) -> int:
    """Put the mode entries of a later run (run_path) into the results of a
    census (base_path), per model, and write all to out_path. Each entry keeps
    how it ran (guarded memory, models sharing its process); a worker that
    crashed or hung is an error of the mode it ran. `guarded`: the run was
    made under guarded memory. Returns models updated."""
    from .census import load_results

    base, run = load_results(base_path), load_results(run_path)
    updated = 0
    for model, r in run.items():
        target = base.get(model)
        if target is None or target.get("status") != "ran":
            continue
        how = {k: r[k] for k in ("check_memory", "models_in_process") if k in r}
        if guarded:  # the whole run was under TORCHNEURON_CHECK_MEMORY=1 (crashed workers say nothing)
            how["check_memory"] = True
        if r.get("status") == "ran":
            entries = {mode: dict(entry, **how) for mode, entry in r.get("modes", {}).items()}
        elif r.get("status") in ("crash", "timeout"):
            entries = {mode: dict(how, forward="error", crashed=True, error=f"{r['status']}: {r.get('reason', '')}")
                       for mode in run_modes(run)}
        else:
            continue
        for mode, entry in entries.items():
            modes = target.setdefault("modes", {})
            before = modes.get(mode)
            if before is not None and before.get("check_memory") and len(entry.get("models_in_process", [])) > 1:
                # A second guarded run, with other models in the process: kept beside the first.
                before["with_others"] = entry
            else:
                modes[mode] = entry
        updated += 1
    with open(out_path, "w") as f:
        for r in base.values():
            f.write(json.dumps(r) + "\n")
    return updated


def run_modes(results: dict) -> list:
    return sorted({m for r in results.values() for m in r.get("modes", {})})


def write_reports(results_path: str, markdown: str, json_path: str, command: str) -> dict:
    from .census import load_results

    results = load_results(results_path)
    previous = None
    if os.path.exists(json_path):
        with open(json_path) as f:
            previous = json.load(f).get("results")
    summary = summarize(results, previous)
    representative = select_representative(results)
    write_markdown(markdown, summary, representative, command)
    slim = {m: {k: v for k, v in r.items() if k not in ("ops", "trace")} for m, r in results.items()}
    with open(json_path, "w") as f:
        json.dump({"summary": summary, "representative": representative, "results": slim}, f, indent=1)
    return {"summary": summary, "representative": representative}
