"""Cold start, restart and compile sharing, each measured with real processes.

    python bench/compile_sharing.py [--procs 4] [--steps 12] [--restarts 3] [--write docs/benchmarks.md]

1. Restart: the demo in a fresh process with an empty cache, then again (a
   restart, warm disk cache); first step vs steady-state step, with CPU eager's
   own first/steady ratio as the reference (PyTorch warms up on its first step
   on any device).
2. Sharing: N processes start the demo at once with a cold cache, in three
   set-ups: each compiles alone (private caches, no service), a shared disk
   cache, and a shared disk cache with the compile service. Reported: the
   slowest process's first step, and total compiles against unique keys.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from report import command_line, machine, write_section  # noqa: E402

_FIRST = re.compile(r"first step ([\d.]+) ms, steady-state step \(median\) ([\d.]+) ms")
_COMPILED = re.compile(r"executables compiled\s*: (\d+)")
_SIGS = re.compile(r"(\d+) op signatures")


def run_demo(env: dict, steps: int, device: str = "neuron", extra: tuple = ()) -> dict:
    full = dict(os.environ, TORCHNEURON_DEVICE_COUNT="1", **env)
    out = subprocess.run([sys.executable, "-m", "torchneuron.demo", "--steps", str(steps), "--device", device,
                          *extra], env=full, capture_output=True, text=True, timeout=1800, check=False)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return parse(out.stdout)


def parse(text: str) -> dict:
    first, steady = map(float, _FIRST.search(text).groups())
    compiled = _COMPILED.search(text)
    sigs = _SIGS.search(text)
    return {"first_ms": first, "steady_ms": steady, "compiles": int(compiled.group(1)) if compiled else 0,
            "signatures": int(sigs.group(1)) if sigs else 0}


def restart(steps: int, restarts: int, extra: tuple = ()) -> dict:
    cache = tempfile.mkdtemp(prefix="tn-bench-")
    try:
        env = {"TORCHNEURON_CACHE_DIR": cache}
        cold = run_demo(env, steps, extra=extra)
        warm, cpu = [], []
        for _ in range(restarts):  # alternate, so that noise hits both alike
            warm.append(run_demo(env, steps, extra=extra))
            cpu.append(run_demo(env, steps, device="cpu", extra=extra))
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    ratio = [w["first_ms"] / w["steady_ms"] for w in warm]
    cpu_ratio = [c["first_ms"] / c["steady_ms"] for c in cpu]
    return {
        "cold": cold,
        "warm_first_ms": statistics.median(w["first_ms"] for w in warm),
        "warm_steady_ms": statistics.median(w["steady_ms"] for w in warm),
        "warm_ratio": statistics.median(ratio),
        "warm_compiles": max(w["compiles"] for w in warm),
        "cpu_first_ms": statistics.median(c["first_ms"] for c in cpu),
        "cpu_steady_ms": statistics.median(c["steady_ms"] for c in cpu),
        "cpu_ratio": statistics.median(cpu_ratio),
        # What the restart adds over PyTorch's own first-step warm-up.
        "warm_excess_ms": statistics.median(w["first_ms"] - w["steady_ms"] for w in warm)
        - statistics.median(c["first_ms"] - c["steady_ms"] for c in cpu),
    }


def start_service(base: str) -> tuple:
    address = os.path.join(base, "s.sock")
    proc = subprocess.Popen([sys.executable, "-m", "torchneuron.cli", "compile-service", "--listen", address,
                             "--cache-dir", os.path.join(base, "shared")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if "listening" not in proc.stdout.readline():
        raise RuntimeError(proc.stderr.read())
    return address, proc


def sharing(setup: str, procs: int, steps: int) -> dict:
    base = tempfile.mkdtemp(prefix="tn-bench-")
    service = None
    try:
        envs = []
        if setup == "service":
            address, service = start_service(base)
        for i in range(procs):
            cache = os.path.join(base, f"private{i}") if setup == "alone" else os.path.join(base, "shared")
            env = {"TORCHNEURON_CACHE_DIR": cache}
            if service is not None:
                env["TORCHNEURON_COMPILE_SERVICE"] = address
            envs.append(env)
        start = time.perf_counter()
        running = [subprocess.Popen([sys.executable, "-m", "torchneuron.demo", "--steps", str(steps)],
                                    env=dict(os.environ, TORCHNEURON_DEVICE_COUNT="1", **env),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for env in envs]
        outs = [p.communicate(timeout=3600) for p in running]
        wall = time.perf_counter() - start
        for p, (_, err) in zip(running, outs):
            if p.returncode != 0:
                raise RuntimeError(err[-3000:])
        results = [parse(out) for out, _ in outs]
        compiles = sum(r["compiles"] for r in results)
        if service is not None:
            from torchneuron.cache.service_client import ServiceClient

            health = ServiceClient(address).health()
            compiles += health["compiles"]
        return {"setup": setup, "slowest_first_s": max(r["first_ms"] for r in results) / 1000,
                "wall_s": wall, "compiles": compiles, "unique_keys": max(r["signatures"] for r in results),
                "service": health if service is not None else None}
    finally:
        if service is not None:
            service.kill()
            service.wait()
        shutil.rmtree(base, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--restarts", type=int, default=3)
    parser.add_argument("--write", help="update this markdown file's section")
    parser.add_argument("--skip-sharing", action="store_true", help="only the restart figures")
    args = parser.parse_args()

    r = restart(args.steps, args.restarts)
    print(json.dumps(r, indent=2))
    wide = restart(args.steps, args.restarts, extra=("--width", "256", "--context", "64"))
    print(json.dumps(wide, indent=2))
    shared = [] if args.skip_sharing else [sharing(s, args.procs, 3) for s in ("alone", "disk", "service")]
    for s in shared:
        print(json.dumps({k: v for k, v in s.items() if k != "service"}))

    lines = [
        "## Cold start, restart and compile sharing",
        "",
        f"Command: `{command_line()}` ({os.cpu_count()} cores). Each figure comes from separate processes.  ",
        f"Machine: {machine()}",
        "",
        "**Restart** (the demo again, with the disk cache its first run filled; restarts and CPU runs "
        f"alternate, medians of {args.restarts}):",
        "",
        "| model | run | first step | steady step | first / steady | compiles |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for label, res in (("demo GPT (width 64, context 32)", r), ("wider GPT (width 256, context 64)", wide)):
        lines += [
            f"| {label} | neuron, cold cache | {res['cold']['first_ms'] / 1000:.1f} s | "
            f"{res['cold']['steady_ms']:.1f} ms | {res['cold']['first_ms'] / res['cold']['steady_ms']:.0f}x | "
            f"{res['cold']['compiles']} |",
            f"| | neuron, restart | {res['warm_first_ms']:.1f} ms | {res['warm_steady_ms']:.1f} ms | "
            f"**{res['warm_ratio']:.2f}x** | {res['warm_compiles']} |",
            f"| | CPU eager | {res['cpu_first_ms']:.1f} ms | {res['cpu_steady_ms']:.1f} ms | "
            f"{res['cpu_ratio']:.2f}x | - |",
        ]
    lines += [
        "",
        "A first step carries PyTorch's own one-time warm-up on any device (the CPU rows). Beyond that "
        f"warm-up, a restart's first step adds {r['warm_excess_ms']:+.1f} ms (demo) and "
        f"{wide['warm_excess_ms']:+.1f} ms (wider model) over its steady step.",
    ]
    if shared:
        alone = shared[0]["slowest_first_s"]
        lines += [
            "",
            f"**{args.procs} processes start the demo at once, cold cache** (first step of the slowest process):",
            "",
            "| set-up | slowest first step | vs alone | all done (wall) | compiles / unique keys |",
            "|---|---:|---:|---:|---:|",
        ]
    names = {"alone": "each compiles alone (private caches)", "disk": "shared disk cache",
             "service": "shared disk cache + compile service"}
    for s in shared:
        lines.append(f"| {names[s['setup']]} | {s['slowest_first_s']:.1f} s | "
                     f"{100 * (1 - s['slowest_first_s'] / alone):.0f}% faster | {s['wall_s']:.1f} s | "
                     f"{s['compiles']} / {s['unique_keys']} |")
    if shared:
        svc = shared[2]["service"]
        lines += ["", f"The service: {svc['requests']} requests, {svc['merged']} merged into a compile in flight, "
                      f"{svc['cache_hits']} answered from its cache, {svc['compiles']} compiles "
                      f"({svc['compile_seconds']:.1f} s), {svc['workers']} workers. In both shared set-ups a "
                      "process that meets a signature another is lowering waits for it (a host-wide lock), so "
                      "the four lower and compile each signature once, in turn."]
    body = "\n".join(lines)
    print(body)
    if args.write:
        write_section(args.write, "compile_sharing", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
