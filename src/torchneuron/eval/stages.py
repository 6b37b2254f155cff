"""`torchneuron eval`: evaluation in stages, fast to thorough.

    unit            tests generated from a shape registry (seconds with a warm cache)
    representative  a small set of real models covering the census's features and ops
    full            the whole model census

Stages run in that order; the run stops at the first failing stage unless
--keep-going. Exit codes: 0 every stage passed, 1 a stage failed, 2 a stage
could not run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

STAGES = ("unit", "representative", "full")
DEMO_REGISTRY = os.path.join(os.path.dirname(__file__), "data", "demo_registry.sqlite")
# Every census model's op signatures (torchneuron eval --stage full --record ...).
CENSUS_REGISTRY = os.path.join(os.path.dirname(__file__), "data", "census_registry.parquet")
DEFAULT_REGISTRY = CENSUS_REGISTRY if os.path.exists(CENSUS_REGISTRY) else DEMO_REGISTRY


def run(args) -> int:
    wanted = [s for s in STAGES if s in set(args.stage)]
    code = 0
    report: dict = {}
    for stage in wanted:
        result = _STAGE_RUNNERS[stage](args)
        report[stage] = result
        if result["status"] != "pass":
            code = max(code, 2 if result["status"] == "unavailable" else 1)
            if not args.keep_going:
                break
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return code


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, disable=not sys.stderr.isatty(), leave=False)


def _unit(args) -> dict:
    from . import registry, unit

    path = args.registry or DEFAULT_REGISTRY
    if not os.path.exists(path):
        print(f"unit: no registry at {path}", file=sys.stderr)
        return {"status": "unavailable", "reason": f"no registry at {path}"}
    cases = registry.rows(path, args.ops)
    everything = len(cases)
    if getattr(args, "sample", None):
        cases = registry.sample(cases, args.sample)
    results_path = getattr(args, "results", None)
    done = {} if results_path is None or getattr(args, "fresh", False) else _unit_results(results_path)
    results = [done[(op, sig)] for op, sig, _, _ in cases if (op, sig) in done]
    todo = [c for c in cases if (c[0], c[1]) not in done]
    if results:
        print(f"unit: {len(results)} signatures already in {results_path}, {len(todo)} to run", file=sys.stderr)
    out = None
    if results_path is not None:
        out = open(results_path, "w" if getattr(args, "fresh", False) else "a")
        if out.tell() and not _ends_with_newline(results_path):
            out.write("\n")  # after a line a stopped run cut short
    try:
        with _progress(len(todo), "unit") as bar:
            def report(result):
                bar.update(1)
                if out is not None:  # each result as it lands: a stopped run resumes where it was
                    out.write(json.dumps(dataclasses.asdict(result)) + "\n")
                    out.flush()

            results += unit.run_cases(todo, on_result=report, batch=_UNIT_BATCH)
    finally:
        if out is not None:
            out.close()
    counts = unit.summarize(results)
    failed = [r for r in results if r.status in ("error", "mismatch")]
    print(f"unit: {len(results)} of {everything} signatures from {path}: "
          + ", ".join(f"{n} {status}" for status, n in sorted(counts.items())))
    for r in failed:
        print(f"  {r.status}: {r.op} {r.sig[:160]}\n    {r.detail[:300]}")
    return {"status": "fail" if failed else "pass", "registry": path, "counts": counts,
            "failures": [{"op": r.op, "sig": r.sig, "status": r.status, "detail": r.detail} for r in failed]}


# Signatures compiled together before any is compared (see unit.run_cases).
_UNIT_BATCH = 256


def _ends_with_newline(path: str) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def _unit_results(path: str) -> dict:
    """(op, signature) -> UnitResult from a unit results file; a line cut
    short by a stopped run is ignored (its case runs again)."""
    from .unit import UnitResult

    found = {}
    try:
        with open(path) as f:
            for line in f:
                try:
                    d = json.loads(line)
                except ValueError:
                    continue
                d["models"] = tuple(d.get("models", ()))
                found[(d["op"], d["sig"])] = UnitResult(**d)
    except FileNotFoundError:
        pass
    return found


DEFAULT_RESULTS = os.path.join("docs", "census.jsonl")


def _models(stage: str):
    def runner(args) -> dict:
        from . import census, census_report

        try:
            import transformers  # noqa: F401
        except ImportError:
            print(f"{stage}: needs transformers (pip install 'torchneuron[eval]')", file=sys.stderr)
            return {"status": "unavailable", "reason": "transformers is not installed"}
        baseline = _baseline(args.baseline)
        if stage == "representative":
            with open(census_report.REPRESENTATIVE) as f:
                models = json.load(f)["models"]
            if args.models:
                models = [m for m in models if m in set(args.models)]
            results_path = args.results or os.path.join(_scratch(), "representative.jsonl")
        else:
            models = args.models or None
            results_path = args.results or DEFAULT_RESULTS
        if args.limit:
            models = (models or [a[0] for a in census.architectures()])[: args.limit]
        bar = _progress(len(models) if models else len(census.architectures()), stage)
        with bar:
            results = census.run_census(results_path, args.modes, models=models, jobs=args.jobs,
                                        timeout=args.timeout, resume=not args.fresh,
                                        on_result=lambda r: bar.update(1),
                                        per_process=getattr(args, "models_per_process", 1),
                                        record=getattr(args, "record", None))
        if models is not None:
            results = {m: r for m, r in results.items() if m in set(models)}
        failures, known = classify_failures(results, args.modes, baseline)
        statuses = {}
        for r in results.values():
            statuses[r.get("status")] = statuses.get(r.get("status"), 0) + 1
        print(f"{stage}: {len(results)} models ({', '.join(f'{v} {k}' for k, v in sorted(statuses.items()))}); "
              f"{len(failures)} new failures, {len(known)} known failures")
        for model, mode, entry in failures:
            print(f"  {model} [{mode}]: {entry}")
        if stage == "full" and args.report:
            census_report.write_reports(results_path, "docs/census.md", "docs/census.json",
                                        "torchneuron " + " ".join(sys.argv[1:]))
        return {"status": "fail" if failures else "pass", "results": results_path,
                "failures": [{"model": m, "mode": mode, "entry": e} for m, mode, e in failures],
                "known_failures": [m for m, _, _ in known]}

    return runner


# Not a backend result: the model cannot be built here, or CPU itself fails on its inputs.
_NOT_BACKEND_RESULTS = ("not-buildable", "reference-error")


def classify_failures(results: dict, modes, baseline: dict) -> tuple:
    """(new failures, known failures) as (model, mode, entry) lists. A worker
    that crashed or timed out fails every mode it was to run (its entry says
    why); known means the baseline failed there too."""
    from . import census_report

    failures, known = [], []
    for model, r in sorted(results.items()):
        status = r.get("status")
        if status in _NOT_BACKEND_RESULTS:
            continue
        before = baseline.get(model)
        for mode in modes:
            if status == "ran" and census_report.model_passes(r, mode):
                continue
            entry = (r.get("modes") or {}).get(mode) if status == "ran" else \
                {"status": status, "reason": r.get("reason")}
            was_failing = before is not None and before.get("status") not in _NOT_BACKEND_RESULTS and (
                before.get("status") != "ran" or (mode in (before.get("modes") or {})
                                                  and not census_report.model_passes(before, mode)))
            (known if was_failing else failures).append((model, mode, entry))
    return failures, known


def _baseline(path: str | None) -> dict:
    path = path or os.path.join("docs", "census.json")
    try:
        with open(path) as f:
            return json.load(f).get("results", {})
    except (OSError, ValueError):
        return {}


def _scratch() -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="torchneuron-eval-")


_STAGE_RUNNERS = {"unit": _unit, "representative": _models("representative"), "full": _models("full")}
