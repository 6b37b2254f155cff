"""The `torchneuron` command."""

from __future__ import annotations

import argparse
import json
import os
import sys


def _info(args) -> int:
    import torch

    import torchneuron
    from torchneuron.hal import devices as hal

    info = {
        "torchneuron": torchneuron.__version__,
        "torch": torch.__version__,
        "available": torch.neuron.is_available(),
        "device_count": torch.neuron.device_count(),
        "driver": torchneuron.config.settings.driver,
        "memory_model": hal.memory_model_in_use(),
        "available_drivers": list(hal.available_drivers()),
        "drivers": hal.describe_drivers(),
        "dtypes": [str(d).replace("torch.", "") for d in torchneuron.supported_dtypes()],
        "target_cpu": _target_cpu_info(torchneuron.config.settings.target_cpu),
        "settings": torchneuron.config.as_dict(),
    }
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        cpu = info.pop("target_cpu")
        drivers = info.pop("drivers")
        for key, value in info.items():
            print(f"{key:18s} {value}")
        for driver, d in drivers.items():
            found = f"devices: {', '.join(d['devices']) or 'none'}" if "devices" in d else f"no devices ({d['error']})"
            print(f"{'driver ' + driver:18s} {d['memory']} memory; {found}")
        if "error" in cpu:
            print(f"{'target_cpu':18s} {cpu['described']}: {cpu['error']}")
        else:
            missing = cpu["missing_on_host"]
            runs = "runs here" if not missing else "cannot run here, this host lacks " + ", ".join(missing)
            print(f"{'target_cpu':18s} {cpu['name']} (TORCHNEURON_TARGET_CPU={cpu['described']}; {runs})")
            print(f"{'vector_features':18s} {' '.join(cpu['vector_features'])}")
            print(f"{'microkernels':18s} {'on' if cpu['microkernels'] else 'off'}")
    return 0


def _target_cpu_info(described: str) -> dict:
    """The CPU executables are compiled for, as the compiler resolved it."""
    from torchneuron.compiler import target_cpu
    from torchneuron.compiler.iree_compile import cpu_flags

    try:
        cpu = target_cpu.resolve(described)
        missing = target_cpu.missing_on_host(cpu)
    except RuntimeError as e:
        return {"described": described, "error": str(e)}
    return {
        "described": described,
        "name": cpu.name,
        "triple": cpu.triple,
        "vector_features": cpu.vector_features(),
        "microkernels": "--iree-llvmcpu-enable-ukernels=all" in cpu_flags(cpu),
        "missing_on_host": missing,
    }


def _demo(args) -> int:
    from torchneuron import demo

    return demo.main(["--steps", str(args.steps)])


def _evaluation_settings(args) -> str | None:
    """Evaluations compare compiled results: each op waits for its build
    instead of running on the host meanwhile (here and in the workers they
    start), unless TORCHNEURON_COMPILE_WAIT says otherwise. `--driver` runs
    them on that IREE driver (the environment carries it to the workers).
    Returns why the driver cannot be used, or None."""
    if getattr(args, "driver", None):
        os.environ["TORCHNEURON_DRIVER"] = args.driver
    import torchneuron
    from torchneuron.hal import devices as hal

    os.environ.setdefault("TORCHNEURON_COMPILE_WAIT", "1")
    torchneuron.config.set(compile_wait=os.environ["TORCHNEURON_COMPILE_WAIT"] != "0")
    if getattr(args, "driver", None):
        torchneuron.config.set(driver=args.driver)
    return hal.driver_problem(torchneuron.config.settings.driver) or hal.memory_problem()


def _conformance(args) -> int:
    import shlex

    problem = _evaluation_settings(args)
    if problem:
        print(f"conformance: {problem}", file=sys.stderr)
        return 2
    import torchneuron
    from torchneuron.eval import conformance

    ops = conformance.CI_OPS if args.ci else args.ops
    results = conformance.run(
        ops=ops, dtypes=args.dtypes, max_samples=args.max_samples, json_path=args.json, resume=args.resume
    )
    command = "torchneuron " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    if torchneuron.config.settings.check_memory:
        command = "TORCHNEURON_CHECK_MEMORY=1 " + command
    if args.markdown:
        conformance.write_markdown(args.markdown, results, command, args.max_samples)
    summary = conformance.summarize(results)
    for dtype, d in summary.items():
        print(f"{dtype}: {d}")
    return 1 if any(d["fail"] for d in summary.values()) and args.strict else 0


def _compile_service(args) -> int:
    import torchneuron
    from torchneuron.service import default_address, service_client
    from torchneuron.service.server import serve

    if args.cache_dir is not None:
        torchneuron.config.set(cache_dir=args.cache_dir)
    address = args.listen or default_address()
    if args.status:
        torchneuron.config.set(compile_service=address)
        try:
            print(json.dumps(service_client().health(), indent=2))
        except (ConnectionError, ValueError) as e:  # ValueError: a misconfigured cache secret
            print(f"no compile service at {address}: {e}", file=sys.stderr)
            return 1
        return 0

    def ready(addr):
        print(f"torchneuron compile service listening on {addr} "
              f"(set TORCHNEURON_COMPILE_SERVICE={addr} in clients)", flush=True)

    try:
        serve(address, args.workers, ready=ready)
    except KeyboardInterrupt:
        pass
    except (ValueError, RuntimeError, OSError) as e:  # no secret off loopback, a bad key file, address in use
        print(f"torchneuron compile-service: {e}", file=sys.stderr)
        return 1
    return 0


def _cache(args) -> int:
    from torchneuron.cache import cli as cache_cli

    return cache_cli.run(args)


def _registry(args) -> int:
    from torchneuron.eval import registry

    if args.action == "stats":
        data = registry.stats(args.path)
        if args.json:
            print(json.dumps(data, indent=2))
        else:
            print(f"{data['signatures']} signatures of {data['ops']} ops, {data['calls']} calls, "
                  f"models: {', '.join(data['models'])}")
            for op, d in data["top_ops"].items():
                print(f"  {op:48s} {d['calls']:8d} calls {d['signatures']:6d} signatures")
    elif args.action == "merge":
        n = registry.merge(args.path, args.sources)
        print(f"merged {n} signatures into {args.path}")
    elif args.action == "export":
        n = registry.export(args.path, args.out)
        print(f"wrote {n} signatures to {args.out}")
    return 0


def _eval(args) -> int:
    problem = _evaluation_settings(args)
    if problem:
        print(f"eval: {problem}", file=sys.stderr)
        return 2
    from torchneuron.eval import stages

    return stages.run(args)


def _profile(args) -> int:
    from .profiler.report import main as profile_main

    return profile_main(args)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="torchneuron", description="torchneuron: the neuron device for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="versions, devices, driver and settings")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=_info)
    p = sub.add_parser("demo", help="train a small transformer on neuron")
    p.add_argument("--steps", type=int, default=30)
    p.set_defaults(fn=_demo)
    p = sub.add_parser("conformance", help="run PyTorch's OpInfo samples on neuron and CPU and compare")
    p.add_argument("--ops", nargs="*", help="OpInfo names (default: all)")
    p.add_argument("--ci", action="store_true", help="the fixed subset of ops models use most")
    p.add_argument("--dtypes", nargs="*", default=["float32"], help="float32 bfloat16 float16 int64 int32 int16 int8 uint8 bool complex64 "
                   "float8_e4m3fn float8_e5m2")
    p.add_argument("--max-samples", type=int, default=3)
    p.add_argument("--json", default="docs/conformance.json",
                   help="(the committed report: give another path for a partial run)")
    p.add_argument("--markdown", default="docs/conformance.md", help="(likewise)")
    p.add_argument("--resume", action="store_true", help="keep results already in the JSON report")
    p.add_argument("--strict", action="store_true", help="exit 1 when any op fails")
    p.add_argument("--driver", default=None,
                   help="IREE driver to run on (local-task, vulkan, cuda, hip; default: TORCHNEURON_DRIVER)")
    p.set_defaults(fn=_conformance)
    p = sub.add_parser("compile-service", help="pool compiling for every torchneuron process on this host")
    p.add_argument("--listen", help="unix socket path or host:port (default: a unix socket in the cache directory)")
    p.add_argument("--workers", type=int, default=None, help="parallel compiles (default: cores minus one)")
    p.add_argument("--cache-dir", default=None, help="executable cache directory (default: TORCHNEURON_CACHE_DIR)")
    p.add_argument("--status", action="store_true", help="print a running service's health and statistics")
    p.set_defaults(fn=_compile_service)
    p = sub.add_parser("cache", help="inspect and manage the persistent executable cache")
    csub = p.add_subparsers(dest="action", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="machine-readable output")
    _add = csub.add_parser
    csub.add_parser = lambda *a, **k: _add(*a, parents=[common], **k)
    csub.add_parser("stats", help="entries, bytes, plans, the directory and its cap")
    q = csub.add_parser("list", help="one line per executable, most recently used first")
    q.add_argument("--limit", type=int, default=50)
    csub.add_parser("clear", help="delete every entry")
    q = csub.add_parser("prune", help="evict least recently used entries down to a size")
    q.add_argument("--max-mb", type=float, default=None, help="target size (default: TORCHNEURON_CACHE_SIZE_MB)")
    csub.add_parser("verify", help="check every entry's checksum; delete bad ones")
    q = csub.add_parser("explain", help="the components of a key; --diff A B: why two keys differ")
    q.add_argument("keys", nargs="+")
    q.add_argument("--diff", action="store_true")
    q = csub.add_parser("export", help="write the cache to a .tar.gz to ship to other machines")
    q.add_argument("file")
    q = csub.add_parser("import", help="add the entries of an exported .tar.gz (each one verified)")
    q.add_argument("file")
    p.set_defaults(fn=_cache)
    p = sub.add_parser("registry", help="the shape registry: op signatures recorded from real runs")
    rsub = p.add_subparsers(dest="action", required=True)
    q = rsub.add_parser("stats", help="signatures, ops, calls, models, the most called ops")
    q.add_argument("path")
    q.add_argument("--json", action="store_true")
    q = rsub.add_parser("merge", help="add the counts of other registries into PATH")
    q.add_argument("path")
    q.add_argument("sources", nargs="+")
    q = rsub.add_parser("export", help="write a registry as JSON lines")
    q.add_argument("path")
    q.add_argument("out")
    p.set_defaults(fn=_registry)
    p = sub.add_parser("eval", help="staged evaluation: unit (generated op tests), then models")
    p.add_argument("--stage", nargs="+", default=["unit"], choices=["unit", "representative", "full"])
    p.add_argument("--registry", default=None, help="shape registry for the unit stage (default: the committed one)")
    p.add_argument("--ops", nargs="*", help="only these ops (unit stage)")
    p.add_argument("--keep-going", action="store_true", help="run later stages after a failing one")
    p.add_argument("--json", default=None, help="write each stage's results here")
    p.add_argument("--modes", nargs="+", default=["compile"], choices=["compile", "host", "torch_compile"],
                   help="execution modes to run models in (model stages); torch_compile: each model forward "
                        "and backward under torch.compile(backend=\"neuron\")")
    p.add_argument("--models", nargs="*", help="only these model types (model stages)")
    p.add_argument("--record", default=None,
                   help="record every model's op signatures into this shape registry (.sqlite or .parquet; "
                        "model stages; a model run again replaces its rows)")
    p.add_argument("--sample", type=int, default=None,
                   help="unit stage: at most this many signatures, spread over ops (the same ones every run)")
    p.add_argument("--limit", type=int, default=None, help="at most this many models")
    p.add_argument("--jobs", type=int, default=1, help="models run in parallel worker processes")
    p.add_argument("--models-per-process", type=int, default=1,
                   help="models each worker runs one after another (default 1: a process per model)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per model before it counts as a hang")
    p.add_argument("--results", default=None, help="JSON-lines results file, written as each result lands and resumed from "
                        "(unit: one line a signature; full: default docs/census.jsonl)")
    p.add_argument("--fresh", action="store_true", help="ignore results already in the results file")
    p.add_argument("--baseline", default=None, help="previous census report (default: docs/census.json)")
    p.add_argument("--report", action="store_true", help="full stage: write docs/census.md and docs/census.json")
    p.add_argument("--driver", default=None,
                   help="IREE driver to run on (local-task, vulkan, cuda, hip; default: TORCHNEURON_DRIVER)")
    p.set_defaults(fn=_eval)
    p = sub.add_parser("profile", help="run a script under torch.profiler: where its time went, with hints")
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    p.add_argument("--top", type=int, default=10, help="source lines and ops to list")
    p.add_argument("--html", default=None, help="write a timeline here (and a PNG of the split beside it)")
    p.add_argument("--parquet", default=None, help="write the Parquet tables into this directory")
    p.set_defaults(fn=_profile)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
