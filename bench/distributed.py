"""Collectives and data parallelism on neuron, in one run: all_reduce bus
bandwidth of float32 tensors on 2 ranks, neuron vs gloo on CPU tensors; the
demo GPT's DDP step on 2 ranks vs 1 rank (the same batch per rank).

    python bench/distributed.py [--rounds 5] [--write docs/benchmarks.md]

All_reduce: neuron and CPU tensors call by call in turn (after 3 warm-up calls
each), the median of rounds x 50 (1 MB) or rounds x 5 (64 MB) synchronous calls; bus bandwidth
as nccl-tests define it, 2 (n - 1) / n * bytes / time. DDP: the steady step
(median of the second half of 20 steps) in a 1-rank and a 2-rank group, in
turn for the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TORCHNEURON_CACHE_DIR", tempfile.mkdtemp(prefix="tn-bench-"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

SIZES_MB = (1, 64)
ITERS = {1: 50, 64: 5}  # calls per timed block: the small size is noisier


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torchneuron  # noqa: F401

    torch.neuron.set_device(rank)
    dist.init_process_group("cpu:gloo,neuron:neuron", rank=rank, world_size=world)


def _all_reduce_worker(rank, world, port, out, rounds):
    _start(rank, world, port)
    seconds = {(mb, device): [] for mb in SIZES_MB for device in ("neuron", "cpu")}
    tensors = {(mb, device): torch.ones(mb * 2**20 // 4, device=device) for mb, device in seconds}

    def timed(mb, device):
        started = time.perf_counter()
        dist.all_reduce(tensors[(mb, device)])
        if device == "neuron":
            torch.neuron.synchronize()
        return time.perf_counter() - started

    for mb in SIZES_MB:
        for device in ("neuron", "cpu"):
            for _ in range(3):
                timed(mb, device)
        # Call by call in turn: the machine's noise moves both figures alike.
        for _ in range(rounds * ITERS[mb]):
            for device in ("neuron", "cpu"):
                seconds[(mb, device)].append(timed(mb, device))
    if rank == 0:
        with open(out, "w") as f:
            json.dump({f"{mb} {device}": statistics.median(v) for (mb, device), v in seconds.items()}, f)
    dist.destroy_process_group()


def _ddp_worker(rank, world, port, out, steps):
    _start(rank, world, port)
    from torch.nn.parallel import DistributedDataParallel

    from torchneuron.models import GPTConfig, train_gpt

    times, last = [], [0.0]

    def on_step(step, loss):
        now = time.perf_counter()
        times.append(now - last[0])
        last[0] = now

    wrap = lambda m: DistributedDataParallel(m)  # noqa: E731
    train_gpt("neuron", 4, cfg=GPTConfig(), wrap=wrap)  # warm-up: every executable built
    import torchneuron

    torchneuron.wait_for_compiles()
    last[0] = time.perf_counter()
    train_gpt("neuron", steps, cfg=GPTConfig(), wrap=wrap, on_step=on_step)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(statistics.median(times[len(times) // 2:]), f)
    dist.destroy_process_group()


def _run(fn, world, *args) -> object:
    out = tempfile.mktemp(suffix=".json")
    mp.start_processes(fn, args=(world, _port(), out, *args), nprocs=world, start_method="spawn")
    with open(out) as f:
        return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--write")
    args = parser.parse_args()
    from report import command_line, machine, publish

    os.environ["TORCHNEURON_DEVICE_COUNT"] = "2"
    reduce = _run(_all_reduce_worker, 2, args.rounds)
    _run(_ddp_worker, 2, 4)  # fills the executable cache for both
    ddp = {1: [], 2: []}
    for _ in range(args.rounds):
        for world in (1, 2):
            ddp[world].append(_run(_ddp_worker, world, 20))
    step = {world: statistics.median(v) for world, v in ddp.items()}

    def bus_gbps(mb, device):
        return 2 * (2 - 1) / 2 * mb * 2**20 / reduce[f"{mb} {device}"] / 1e9

    lines = [
        "## Distributed: all_reduce bandwidth and DDP",
        "",
        f"Command: `{command_line()}`  ",
        f"Machine: {machine()}  ",
        f"2 ranks on one host (loopback), `init_process_group(\"cpu:gloo,neuron:neuron\")`. All_reduce: "
        f"float32, neuron and CPU tensors call by call in turn, the median of {args.rounds * ITERS[1]} (1 MB) or "
        f"{args.rounds * ITERS[64]} (64 MB) synchronous calls each (the neuron figure includes waiting for the device); bus bandwidth = 2 (n - 1) / n * bytes / time.",
        "",
        "| size | neuron | gloo on CPU tensors | neuron / CPU bandwidth |",
        "|---|---:|---:|---:|",
    ]
    for mb in SIZES_MB:
        n, c = bus_gbps(mb, "neuron"), bus_gbps(mb, "cpu")
        lines.append(f"| {mb} MB | {n:.2f} GB/s ({reduce[f'{mb} neuron'] * 1e3:.2f} ms) | {c:.2f} GB/s "
                     f"({reduce[f'{mb} cpu'] * 1e3:.2f} ms) | {n / c:.2f}x |")
    lines += [
        "",
        f"DDP: the demo GPT's training step (batch 8 per rank), steady, {args.rounds} rounds in turn; 2 ranks "
        "share the machine's cores.",
        "",
        "| ranks | step | samples per second | 2 ranks / 1 rank step time |",
        "|---|---:|---:|---:|",
    ]
    for world in (1, 2):
        lines.append(f"| {world} | {step[world] * 1e3:.1f} ms | {8 * world / step[world]:.0f} | "
                     f"{step[world] / step[1]:.2f}x |")
    publish(lines, args.write, "distributed")


if __name__ == "__main__":
    main()
