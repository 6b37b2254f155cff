"""Exact allocation statistics per device, kept by the C++ allocator."""

from __future__ import annotations

from collections import OrderedDict

from .. import _C
from ..hal.index import device_index


def memory_allocated(device=None) -> int:
    """Bytes held by live neuron tensors on the device."""
    return _C.memory_stats(device_index(device))["allocated"]


def max_memory_allocated(device=None) -> int:
    """The peak of memory_allocated() since start or the last reset_peak_memory_stats()."""
    return _C.memory_stats(device_index(device))["peak"]


def reset_peak_memory_stats(device=None) -> None:
    _C.reset_peak_memory(device_index(device))


def memory_reserved(device=None) -> int:
    """Bytes held by live tensors plus freed blocks the allocator keeps for reuse."""
    s = _C.memory_stats(device_index(device))
    return s["allocated"] + s["cached"]


def memory_stats(device=None) -> "OrderedDict[str, int]":
    """The allocator's statistics, under the key names torch.cuda.memory_stats() uses."""
    s = _C.memory_stats(device_index(device))
    return OrderedDict(
        [
            ("allocated_bytes.all.current", s["allocated"]),
            ("allocated_bytes.all.peak", s["peak"]),
            ("allocation.all.allocated", s["num_allocs"]),
            ("allocation.all.freed", s["num_frees"]),
            ("allocation.all.current", s["num_allocs"] - s["num_frees"]),
            ("reserved_bytes.all.current", s["allocated"] + s["cached"]),
            ("inactive_split_bytes.all.current", s["cached"]),
            ("num_ooms", s["num_ooms"]),
            ("memory_limit_bytes", s["limit"]),
        ]
    )


def empty_cache(device=None) -> None:
    """Give the freed blocks the allocator keeps for reuse back to the device
    (small blocks, up to 64 MiB per device, are kept; larger ones never are)."""
    if device is None:
        for index in range(_C.device_count()):
            _C.empty_cache(index)
    else:
        _C.empty_cache(device_index(device))


def set_memory_limit(limit_bytes: int, device=None) -> None:
    """Cap the memory of one device; allocations past it raise torch.OutOfMemoryError. 0: no cap."""
    _C.set_memory_limit(device_index(device), int(limit_bytes))


def memory_limit(device=None) -> int:
    return _C.memory_stats(device_index(device))["limit"]


def mem_get_info(device=None) -> tuple:
    """(free, total) bytes of the device, as torch.cuda.mem_get_info (and
    torch.accelerator.get_memory_info). With a memory limit the device is
    that big; without one it is the host's memory (the CPU target's memory is
    the host's; IREE reports no size for a device's own memory), free being
    what the host has available less the freed blocks the allocator keeps."""
    return tuple(_C.mem_get_info(device_index(device)))
