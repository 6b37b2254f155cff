"""Every target present, each against CPU eager in the same process: the
demo training step, a 1024x1024 matmul, and transfer bandwidth, with the
bytes a steady step moves each way.

    python bench/targets.py [--steps 12] [--repeats 5] [--write docs/benchmarks.md]

Targets: the CPU driver with unified memory (the default), the CPU driver
forced to the discrete model (TORCHNEURON_MEMORY=discrete: every tensor a
device buffer reached through transfers), and each driver with a device
here (Vulkan on lavapipe, Mesa's software driver; CUDA where a GPU is). Each
target runs in a process of its own (the memory model is fixed once a device
allocated), in op mode with compiles waited for; its steady step is the
median of the steps after every executable landed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

TARGETS = {
    "local-task (unified)": {"TORCHNEURON_DRIVER": "local-task", "TORCHNEURON_MEMORY": "unified"},
    "local-task (discrete)": {"TORCHNEURON_DRIVER": "local-task", "TORCHNEURON_MEMORY": "discrete"},
    "vulkan": {"TORCHNEURON_DRIVER": "vulkan"},
    "cuda": {"TORCHNEURON_DRIVER": "cuda"},
    "hip": {"TORCHNEURON_DRIVER": "hip"},
}


def _child(steps: int, repeats: int) -> dict:
    import torch

    import torchneuron
    from report import time_interleaved
    from torchneuron.models import GPTConfig, train_gpt

    out = {"device": torch.neuron.get_device_name(), "memory_model": torchneuron.transfer_stats()["memory_model"]}
    # The demo step: per-step times on each device, alternating rounds.
    step_times = {"neuron": [], "cpu": []}
    moved = []

    def on_step_of(device):
        last = [time.perf_counter()]

        def on_step(step, loss):
            now = time.perf_counter()
            step_times[device].append(now - last[0])
            last[0] = now
            if device == "neuron":
                moved.append(torchneuron.transfer_stats())
                torchneuron.reset_transfer_stats()
        return on_step

    train_gpt("neuron", 3, cfg=GPTConfig())  # every executable built (compiles are waited for)
    torch.neuron.synchronize()
    step_times["neuron"].clear()
    for _ in range(2):
        for device in ("cpu", "neuron"):
            before = len(step_times[device])
            train_gpt(device, steps, cfg=GPTConfig(), on_step=on_step_of(device))
            del step_times[device][before:before + 2]  # the first steps of a run build its optimizer state
    out["step_ms"] = {d: statistics.median(t) * 1e3 for d, t in step_times.items()}
    steady = moved[len(moved) // 2:]
    out["step_bytes"] = {k: statistics.median(m[k] for m in steady)
                         for k in ("host_to_device", "device_to_host", "device_to_device")}
    # A 1024x1024 float32 matmul.
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    an, bn = a.to("neuron"), b.to("neuron")
    times = time_interleaved({"neuron": lambda: an @ bn, "cpu": lambda: a @ b}, repeats=repeats, inner=3)
    out["matmul_ms"] = {k: v * 1e3 for k, v in times.items()}
    # Transfer bandwidth: 64 MiB each way (and a CPU copy of the same size for scale).
    host = torch.randn(16 << 20)
    dev = host.to("neuron")
    torch.neuron.synchronize()
    pinned = host.pin_memory()
    landing = torch.empty_like(host, pin_memory=True)

    def pinned_to_device():
        pinned.to("neuron", non_blocking=True)
        torch.neuron.synchronize()

    def pinned_to_host():
        landing.copy_(dev, non_blocking=True)
        torch.neuron.synchronize()

    times = time_interleaved({
        "to_device": lambda: host.to("neuron"),
        "to_host": lambda: dev.to("cpu"),
        "pinned_to_device": pinned_to_device,
        "pinned_to_host": pinned_to_host,
        "cpu_clone": lambda: host.clone(),
    }, repeats=repeats, inner=1, warmup=1)
    out["bandwidth_gb_s"] = {k: host.nbytes / v / 1e9 for k, v in times.items()}
    return out


def _available(env: dict) -> bool:
    probe = subprocess.run([sys.executable, "-c", "import torch, torchneuron; print(torch.neuron.is_available())"],
                           env=dict(os.environ, **env), capture_output=True, text=True, timeout=300)
    return probe.stdout.strip().endswith("True")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--write")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT" + json.dumps(_child(args.steps, args.repeats)))
        return
    from report import command_line, machine, publish

    results = {}
    for name, env in TARGETS.items():
        if not _available(env):
            print(f"{name}: no device here, skipped")
            continue
        env = dict(os.environ, **env, TORCHNEURON_COMPILE_WAIT="1", TORCHNEURON_EAGER_MODE="op",
                   TORCHNEURON_CACHE_DIR=tempfile.mkdtemp(prefix="tn-targets-"))
        started = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, "--child", "--steps", str(args.steps),
                               "--repeats", str(args.repeats)], env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"{name}: failed\n{proc.stderr[-3000:]}")
            continue
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT")][-1]
        results[name] = json.loads(line[len("RESULT"):])
        print(f"{name}: {time.perf_counter() - started:.0f} s, {results[name]}")
    lines = [
        "## Targets: each driver against CPU eager",
        "",
        f"Command: `{command_line()}`  ",
        f"Machine: {machine()}  ",
        f"Demo GPT (2 layers, width 64, context 32, batch 8, AdamW) in op mode, each target in its own process "
        f"with CPU eager timed in the same process, alternating; steady steps after every executable was built "
        f"(medians of {2 * (args.steps - 2)} steps each). Bytes per step: what a steady step copied each way. "
        f"Bandwidth: a 64 MiB float32 tensor copied each way (medians of {args.repeats}), from pageable memory "
        f"and from pinned memory with non_blocking=True (then synchronized), beside a host clone.",
        "",
        "| target | device | memory | demo step | CPU step | step / CPU | bytes in / out per step "
        "| matmul 1024 | CPU matmul | matmul / CPU | to device | to host | pinned to device | pinned to host "
        "| host clone |",
        "|---|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        s, m, bw, moved = r["step_ms"], r["matmul_ms"], r["bandwidth_gb_s"], r["step_bytes"]
        lines.append(
            f"| {name} | {r['device']} | {r['memory_model']} | {s['neuron']:.1f} ms | {s['cpu']:.1f} ms | "
            f"{s['neuron'] / s['cpu']:.2f}x | {moved['host_to_device']:.0f} B / {moved['device_to_host']:.0f} B | "
            f"{m['neuron']:.2f} ms | {m['cpu']:.2f} ms | {m['neuron'] / m['cpu']:.2f}x | "
            f"{bw['to_device']:.2f} GB/s | {bw['to_host']:.2f} GB/s | {bw['pinned_to_device']:.2f} GB/s | "
            f"{bw['pinned_to_host']:.2f} GB/s | {bw['cpu_clone']:.2f} GB/s |"
        )
    lines += [
        "",
        "The unified model moves no bytes (device memory is host memory). On the discrete ones a steady step "
        "moves its batch in, its loss out, and the operands and results of its host-path ops (dropout masks "
        "come from PyTorch's CPU generator), plus a few bytes of index-check flags.",
        "",
        "Pinned copies land in host memory allocated once (a pageable `.to()` allocates and faults in a fresh "
        "tensor each time, as the host clone does): a non_blocking copy between pinned memory and the device is "
        "queued on the stream and imports the pinned block in place, without a staging copy. lavapipe runs "
        "Vulkan compute on the CPU with IREE's baseline profile (32-bit compute, no subgroup operations; int64 "
        "ops run on the host path): it stands in for a device with memory of its own in CI, not for speed.",
    ]
    publish(lines, args.write, "targets")


if __name__ == "__main__":
    main()
