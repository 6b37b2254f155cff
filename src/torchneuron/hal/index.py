"""Turning the ways users name a neuron device into an index."""

from __future__ import annotations

import torch

from .. import _C


def device_index(device=None, optional: bool = True) -> int:
    """None / int / "neuron" / "neuron:1" / torch.device -> a checked index."""
    if device is None:
        return _C.current_device()
    if isinstance(device, int):
        index = device
    else:
        dev = torch.device(device)
        if dev.type != "neuron":
            raise ValueError(f"Expected a neuron device, but got: {dev}")
        index = dev.index if dev.index is not None else _C.current_device()
    _C.check_device_index(index)
    return index
