"""Zero-copy aliases between neuron tensors and IREE buffer views.

On the unified model (the CPU target) a neuron storage is host memory that
IREE imports (DLPack) as a device-local, host-visible buffer, so compiled
executables read and write tensors in place. On the discrete model a tensor's
buffer view is a view of its device buffer, which the host cannot alias.
"""

from __future__ import annotations

import torch
import torch.utils.dlpack

from .. import _C
from ..hal.devices import hal_device
from . import device_memory


def to_buffer_view(t: torch.Tensor):
    """An IREE HalBufferView over a dense neuron tensor's memory (no copy)."""
    if t.device.type != "neuron":
        raise ValueError(f"to_buffer_view expects a neuron tensor, got one on {t.device}")
    if not t.is_contiguous():
        raise ValueError("to_buffer_view needs a contiguous tensor; call .contiguous() first")
    if _C.discrete_memory():
        return device_memory.existing(t.device.index).view_at(t.data_ptr(), tuple(t.shape), t.dtype)
    return hal_device(t.device.index).from_dlpack_capsule(torch.utils.dlpack.to_dlpack(_C.host_alias(t)))


def from_buffer_view(view, device_index: int = 0) -> torch.Tensor:
    """A CPU tensor over an IREE buffer view's memory (no copy; unified model only)."""
    if _C.discrete_memory():
        raise RuntimeError(
            "from_buffer_view: on the discrete memory model the host cannot alias device memory; "
            "copy the tensor to the host (tensor.cpu()) instead"
        )
    return torch.from_dlpack(hal_device(device_index).create_dlpack_capsule(view, 1, 0))
