"""`make demo`: train a small transformer on neuron and summarize how its ops ran."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import torchneuron
from torchneuron.dispatch import eager
from torchneuron.models import GPTConfig, train_gpt


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--device", default="neuron")
    parser.add_argument("--width", type=int, default=GPTConfig.n_embd, help="embedding width")
    parser.add_argument("--layers", type=int, default=GPTConfig.n_layer)
    parser.add_argument("--context", type=int, default=GPTConfig.block_size)
    parser.add_argument("--eager-mode", choices=("op", "adaptive"),
                        help="op-by-op or adaptive eager (default: the TORCHNEURON_EAGER_MODE setting)")
    parser.add_argument("--profile", metavar="DIR",
                        help="run under torch.profiler and write the trace, Parquet tables, report and timeline into DIR")
    args = parser.parse_args(argv)
    if args.eager_mode:
        torchneuron.set_eager_mode(args.eager_mode)
    if not args.profile:
        return _run(args)
    from torch.profiler import ProfilerActivity, profile

    from torchneuron.profiler.report import save, text_report

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1], record_shapes=True) as prof:
        _run(args)
        torch.neuron.synchronize()
    print()
    print(text_report(prof))
    for what, path in save(prof, args.profile).items():
        print(f"wrote {what:<9} {path}")
    return 0


def _run(args) -> int:

    cfg = GPTConfig(n_embd=args.width, n_layer=args.layers, block_size=args.context)
    print(f"torchneuron {torchneuron.__version__} | torch {torch.__version__} | "
          f"device {args.device}: {torch.neuron.get_device_name()}")
    print(f"GPT: {cfg.n_layer} layers, {cfg.n_head} heads, width {cfg.n_embd}, "
          f"context {cfg.block_size}, vocab {cfg.vocab_size}")
    torchneuron.reset_stats()
    times = []
    last = [time.perf_counter()]

    def tick():
        now = time.perf_counter()
        times.append(now - last[0])
        last[0] = now

    def on_step(step, loss):
        tick()
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {loss:.4f}  step time {times[-1] * 1000:7.1f} ms")

    setup = []

    def on_ready():
        now = time.perf_counter()
        setup.append(now - last[0])
        last[0] = now

    started = time.perf_counter()
    losses = train_gpt(args.device, args.steps, cfg=cfg, on_step=on_step, on_ready=on_ready)
    torch.neuron.synchronize()
    stats = torchneuron.execution_stats()
    fallback = torchneuron.fallback_ops()
    compile_stats = torchneuron.compile_stats()
    steady = statistics.median(times[len(times) // 2:])
    compute = stats["ops_compiled"] + stats["ops_on_host_fallback"]
    print()
    print("=" * 64)
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps "
          f"(execution: {torchneuron.config.settings.execution}, eager mode: {torchneuron.get_eager_mode()})")
    print(f"model and optimizer set-up {setup[0] * 1000:.1f} ms")
    print(f"first step {times[0] * 1000:.1f} ms, steady-state step (median) {steady * 1000:.1f} ms "
          f"(first/steady {times[0] / steady:.2f}x)")
    print(f"ops dispatched to neuron : {stats['ops_dispatched']} ({stats['distinct_ops']} distinct)")
    if compute:
        print(f"ops run compiled         : {stats['ops_compiled']} "
              f"({100 * stats['ops_compiled'] / compute:.1f}% of compute ops)")
    print(f"ops on host fallback     : {stats['ops_on_host_fallback']} "
          f"({stats['distinct_fallback_ops']} distinct)")
    print(f"host reads and copies    : {stats['transfers']}")
    building = eager.builds_in_flight()  # a cold run's steps end before its background builds do
    print(f"executables compiled     : {compile_stats['compiles']} in {compile_stats['compile_seconds']:.1f} s "
          f"({compile_stats['hits']} in-memory hits, {compile_stats['signatures']} op signatures)"
          + (f", {building} still building in the background" if building else ""))
    loaded = {k: v for k, v in compile_stats["sources"].items() if v and k != "compiled"}
    if loaded:
        print("executables reused       : " + ", ".join(f"{v} from {k}" for k, v in loaded.items()))
    print(f"memory: {torch.neuron.memory_allocated() / 2**20:.1f} MiB allocated, "
          f"peak {torch.neuron.max_memory_allocated() / 2**20:.1f} MiB")
    if torchneuron.get_eager_mode() == "adaptive":
        a = torchneuron.adaptive_stats()
        print(f"adaptive graphs          : {a['graphs_cut']} cut ({a['ops_per_graph']} ops each; "
              + ", ".join(f"{k} {v}" for k, v in sorted(a["cut_reasons"].items(), key=lambda kv: -kv[1])[:4] if v)
              + ")")
        print(f"adaptive launches        : {a['ops_fused']} of {a['ops_recorded']} ops fused; graphs run "
              + ", ".join(f"{k} {v}" for k, v in a["launches"].items())
              + f"; {a['graphs_compiled']} built whole, {a['graphs_segmented']} in segments")
        print(f"adaptive compile seconds : {a['compile_seconds_hidden']:.1f} s in the background, "
              f"{a['compile_seconds_exposed']:.1f} s waited; "
              f"{a['bytes_not_written'] / 2**20:.1f} MiB of dead results not written")
    if args.device == "neuron":
        print(f"ops on host while compiling: {stats['ops_on_host_while_compiling']} "
              f"({stats['op_builds_in_background']} op builds in the background, {stats['op_builds_in_line']} "
              f"in line, {stats['op_compile_seconds_waited']:.1f} s waited)")
        if stats["op_builds_in_background"]:
            # The steps above ran partly on the host path while executables
            # built; show the speed once they have all landed.
            torchneuron.wait_for_compiles()
            landed = time.perf_counter() - started
            times.clear()
            last[0] = time.perf_counter()
            train_gpt(args.device, 10, cfg=cfg, on_step=lambda step, loss: tick())
            compiled = torchneuron.compile_stats()["compiles"]
            print(f"every compile landed     : {landed:.1f} s after training began ({compiled} executables "
                  f"compiled); then a steady step took {statistics.median(times[5:]) * 1000:.1f} ms")
    top = sorted(fallback.items(), key=lambda kv: -kv[1])[:8]
    print("top host-fallback ops   : " + ", ".join(f"{k} x{v}" for k, v in top))
    print("=" * 64)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
