"""`torchneuron eval`: evaluation in stages, fast to thorough.

    unit            tests generated from a shape registry (seconds with a warm cache)
    representative  a small set of real models covering the census's features and ops
    full            the whole model census

Stages run in that order; the run stops at the first failing stage unless
--keep-going. Exit codes: 0 every stage passed, 1 a stage failed, 2 a stage
could not run.
"""

from __future__ import annotations

import json
import os
import sys

STAGES = ("unit", "representative", "full")
DEFAULT_REGISTRY = os.path.join(os.path.dirname(__file__), "data", "demo_registry.sqlite")


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
    results = []
    with _progress(len(cases), "unit") as bar:
        for op, sig, _, models in cases:
            r = unit.run_case(op, sig)
            r.models = tuple(models)
            results.append(r)
            bar.update(1)
    counts = unit.summarize(results)
    failed = [r for r in results if r.status in ("error", "mismatch")]
    print(f"unit: {len(results)} signatures from {path}: "
          + ", ".join(f"{n} {status}" for status, n in sorted(counts.items())))
    for r in failed:
        print(f"  {r.status}: {r.op} {r.sig[:160]}\n    {r.detail[:300]}")
    return {"status": "fail" if failed else "pass", "registry": path, "counts": counts,
            "failures": [{"op": r.op, "sig": r.sig, "status": r.status, "detail": r.detail} for r in failed]}


def _models(stage: str):
    def runner(args) -> dict:
        reason = "the model census is not built yet"
        print(f"{stage}: cannot run: {reason}", file=sys.stderr)
        return {"status": "unavailable", "reason": reason}

    return runner


_STAGE_RUNNERS = {"unit": _unit, "representative": _models("representative"), "full": _models("full")}
