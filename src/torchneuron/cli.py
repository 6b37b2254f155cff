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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="torchneuron", description="torchneuron: the neuron device for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="versions, devices, driver and settings")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=_info)
    p = sub.add_parser("demo", help="train a small transformer on neuron")
    p.add_argument("--steps", type=int, default=30)
    p.set_defaults(fn=_demo)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
