"""The `torchneuron` command."""

from __future__ import annotations

import argparse
import json
import sys


def _info(args) -> int:
    import torch

    import torchneuron
    from torchneuron.device import hal

    info = {
        "torchneuron": torchneuron.__version__,
        "torch": torch.__version__,
        "available": torch.neuron.is_available(),
        "device_count": torch.neuron.device_count(),
        "driver": torchneuron.config.settings.driver,
        "available_drivers": list(hal.available_drivers()),
        "dtypes": [str(d).replace("torch.", "") for d in torchneuron.supported_dtypes()],
        "settings": torchneuron.config.as_dict(),
    }
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        for key, value in info.items():
            print(f"{key:18s} {value}")
    return 0


def _demo(args) -> int:
    from torchneuron import demo

    return demo.main(["--steps", str(args.steps)])


def _conformance(args) -> int:
    import shlex

    from torchneuron.eval import conformance

    ops = conformance.CI_OPS if args.ci else args.ops
    results = conformance.run(
        ops=ops, dtypes=args.dtypes, max_samples=args.max_samples, json_path=args.json, resume=args.resume
    )
    command = "torchneuron " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    if args.markdown:
        conformance.write_markdown(args.markdown, results, command, args.max_samples)
    summary = conformance.summarize(results)
    for dtype, d in summary.items():
        print(f"{dtype}: {d}")
    return 1 if any(d["fail"] for d in summary.values()) and args.strict else 0


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
    p.add_argument("--dtypes", nargs="*", default=["float32"], help="float32 bfloat16 float16 int64 bool")
    p.add_argument("--max-samples", type=int, default=3)
    p.add_argument("--json", default="docs/conformance.json")
    p.add_argument("--markdown", default="docs/conformance.md")
    p.add_argument("--resume", action="store_true", help="keep results already in the JSON report")
    p.add_argument("--strict", action="store_true", help="exit 1 when any op fails")
    p.set_defaults(fn=_conformance)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
