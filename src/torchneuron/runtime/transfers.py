"""Transfers between host and device memory, and within a device, for the
discrete memory model; every byte is counted (`transfer_stats()`).

On the unified model a neuron storage is host memory, and these are plain
host copies through zero-copy aliases (nothing is counted: nothing crosses).
On the discrete model the host reaches device memory only here: a copy is a
command buffer queued on the device's default timeline, after the launches
queued before it, and waited for: once a copy returns, every stream sees its
bytes (as CUDA's copies from pageable memory behave). Callers that need
other streams' work done synchronize first, as the dispatcher does before
any transfer.
"""

from __future__ import annotations

import numpy as np
import torch

from .. import _C
from ..hal.devices import memory_model_in_use
from ..memory import device_memory
from . import queue as queues


def discrete() -> bool:
    return _C.discrete_memory()


def transfer_stats() -> dict:
    """Bytes and copies each way since start or the last reset_transfer_stats():
    host_to_device, device_to_host, device_to_device (bytes) and *_copies;
    index_check_bytes: the part of device_to_host that read the flags of
    device-side index bound checks; queued_copy_bytes: the part of both
    that non_blocking copies of pinned host memory queued on a stream
    without waiting; memory_guard_bytes: the part of both that guarded
    memory (TORCHNEURON_CHECK_MEMORY) read and wrote around allocations."""
    counts = device_memory.counts()
    keys = ("host_to_device", "device_to_host", "device_to_device")
    out = {k: counts.get(k, 0) for k in keys}
    out.update({f"{k}_copies": counts.get(f"{k}_copies", 0) for k in keys})
    out["index_check_bytes"] = counts.get("index_checks", 0)  # of device_to_host: flags of index bound checks
    out["queued_copy_bytes"] = counts.get("queued", 0)  # of both: non_blocking copies of pinned memory
    out["memory_guard_bytes"] = counts.get("memory_guards", 0)  # of both: guarded memory's checks
    out["memory_model"] = memory_model_in_use()
    return out


def reset_transfer_stats() -> None:
    device_memory.reset_counts()


def _rt():
    import iree.runtime as ireert

    return ireert


def _span(t: torch.Tensor) -> tuple:
    """(first byte, end byte) of the storage a view covers, from the storage's start."""
    size = t.element_size()
    if t.numel() == 0:
        start = t.storage_offset() * size
        return start, start
    first = t.storage_offset()
    last = first + sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 0)
    return first * size, (last + 1) * size


def _storage_address(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def read_bytes(index: int, address: int, nbytes: int) -> np.ndarray:
    """`nbytes` of device memory at `address`, copied to a new host array
    after the launches queued before it on the default stream."""
    if nbytes == 0:
        return np.empty(0, np.uint8)
    queue = queues.device_queue(index)
    buffer, offset = queue.memory.buffer_at(address)
    staging = queue.memory.staging_for_reading(nbytes)
    commands = _rt().HalCommandBuffer(queue.task.device)
    commands.copy(buffer, staging, offset, 0, nbytes, end=True)
    queue.submit_and_wait(commands, "copy to the host")
    device_memory.count("device_to_host", nbytes)
    return staging.map().asarray((nbytes,), np.dtype(np.uint8)).copy()


def write_bytes(index: int, address: int, data: np.ndarray) -> None:
    """Copy a host array's bytes to device memory at `address` (queued in order)."""
    data = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    if data.size == 0:
        return
    queue = queues.device_queue(index)
    buffer, offset = queue.memory.buffer_at(address)
    staging = queue.memory.staging_with(data)
    commands = _rt().HalCommandBuffer(queue.task.device)
    commands.copy(staging, buffer, 0, offset, data.size, end=True)
    # Waited for, as CUDA's copies from pageable memory are: once it returns,
    # every stream sees the bytes, and the host array may change.
    queue.submit_and_wait(commands, "copy to the device")
    device_memory.count("host_to_device", data.size)


def queued_copy(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool) -> bool:
    """dst.copy_(src, non_blocking=True) between pinned host memory and the
    device: queued on the current stream and not waited for, as CUDA does
    (the host memory must not be changed, or read, until the stream has
    passed the copy: synchronize the stream or wait for an event). False
    where the copy must be done the ordinary, waited-for way: pageable host
    memory, a cast, a broadcast, a strided side, or the unified model (whose
    device memory is host memory: its copies are host copies, done at once)."""
    if not non_blocking or not discrete():
        return False
    to_device = dst.device.type == "neuron"
    host, device = (src, dst) if to_device else (dst, src)
    if (host.device.type != "cpu" or device.device.type != "neuron" or src.dtype != dst.dtype
            or src.shape != dst.shape or not src.is_contiguous() or not dst.is_contiguous()
            or src.is_conj() or src.is_neg() or host.nbytes == 0):
        return False
    start, size = _C.pinned_block_of(host.data_ptr())
    if size == 0:
        return False
    index = device.device.index
    queues.queue_recorded(index, "a queued copy")  # recorded ops on this device come first
    queue = queues.device_queue(index)
    rt = _rt()
    pinned = queue.memory.import_pinned(start, size)
    buffer, offset = queue.memory.buffer_at(device.data_ptr())
    nbytes, at = host.nbytes, host.data_ptr() - start
    commands = rt.HalCommandBuffer(queue.task.device)
    if to_device:
        commands.copy(pinned, buffer, at, offset, nbytes, end=True)
    else:
        commands.copy(buffer, pinned, offset, at, nbytes, end=True)
    what = "copy to the device" if to_device else "copy to the host"
    queue.submit(commands, (pinned, src, dst), what, stream=_C.current_stream(index))
    device_memory.count("host_to_device" if to_device else "device_to_host", nbytes)
    device_memory.count("queued", nbytes)
    return True


def copy_addresses(dst: int, src: int, nbytes: int, index: int) -> None:
    """Device-to-device copy of `nbytes` (storage resize, storage copies)."""
    if nbytes == 0:
        return
    rt = _rt()
    queue = queues.device_queue(index)
    src_buffer, src_offset = queue.memory.buffer_at(src)
    dst_buffer, dst_offset = queue.memory.buffer_at(dst)
    commands = rt.HalCommandBuffer(queue.task.device)
    commands.copy(src_buffer, dst_buffer, src_offset, dst_offset, nbytes, end=True)
    queue.submit(commands, [], "copy within the device")
    device_memory.count("device_to_device", nbytes)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor with a neuron tensor's values, sizes and strides: its
    storage holds only the bytes the view covers (the storage offset is
    counted from their start)."""
    if not discrete():
        return _C.host_alias(t)
    start, end = _span(t)
    data = read_bytes(t.device.index, _storage_address(t) + start, end - start)
    return _view_over(torch.from_numpy(data), t, start)


def _view_over(data: torch.Tensor, t: torch.Tensor, start: int) -> torch.Tensor:
    size = t.element_size()
    host = torch.empty(0, dtype=t.dtype)
    host.set_(data.untyped_storage(), t.storage_offset() - start // size, t.shape, t.stride())
    return host


def stage(tensors, blank=()) -> dict:
    """Host copies of several neuron tensors, read once per storage (the
    union of what they cover): {id(tensor): (host tensor, storage start
    byte)}. Views of one storage stay views of one host storage, so an op
    that writes one sees the change in the others. `blank`: tensors to be
    written whole (out= arguments): a dense one alone in its storage gets
    host memory that is not read from the device."""
    staged = {}
    shared = {_storage_address(t) for t in tensors}
    for t in blank:
        if _dense(t) and _storage_address(t) not in shared:
            start, end = _span(t)
            staged[id(t)] = (_view_over(torch.empty(end - start, dtype=torch.uint8), t, start), start)
        else:
            tensors = [*tensors, t]
    spans: dict = {}  # (storage address, device) -> [first byte, end byte, largest element size]
    for t in tensors:
        key = (_storage_address(t), t.device.index)
        start, end = _span(t)
        span = spans.get(key)
        if span is None:
            spans[key] = [start, end, t.element_size()]
        else:
            span[0], span[1], span[2] = min(span[0], start), max(span[1], end), max(span[2], t.element_size())
    storages = {}
    for (address, index), (start, end, size) in spans.items():
        start -= start % size  # so that each view's offset is whole elements from it
        storages[(address, index)] = (torch.from_numpy(read_bytes(index, address + start, end - start)), start)
    for t in tensors:
        data, start = storages[(_storage_address(t), t.device.index)]
        staged[id(t)] = (_view_over(data, t, start), start)
    return staged


def _bytes(storage, first: int, end: int) -> np.ndarray:
    """Bytes [first, end) of a host storage, as an array over it (no copy)."""
    return torch.empty(0, dtype=torch.uint8).set_(storage, first, (end - first,), (1,)).numpy()


def write_back(t: torch.Tensor, host: torch.Tensor, start: int) -> None:
    """Copy the bytes a host copy's view covers back into the neuron tensor's
    storage (`start`: the storage byte the host storage begins at)."""
    first, end = _span(host)
    if end > first:
        write_bytes(t.device.index, _storage_address(t) + start + first, _bytes(host.untyped_storage(), first, end))


def write_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) for a neuron dst and a host src (broadcast and cast as copy_ does)."""
    if not discrete():
        _C.host_alias(dst).copy_(src)
        return
    if dst.is_contiguous():
        values = src.to(dst.dtype).expand(dst.shape).resolve_conj().resolve_neg().contiguous()
        write_bytes(dst.device.index, dst.data_ptr(), values.view(-1).view(torch.uint8).numpy())
        return
    start, _ = _span(dst)
    host = to_host(dst)  # a strided view: the bytes between its elements are kept
    host.copy_(src)
    write_back(dst, host, start)


def _dense(t: torch.Tensor) -> bool:
    from torch._prims_common import is_non_overlapping_and_dense_or_false

    return is_non_overlapping_and_dense_or_false(t)


def device_copy_of(host: torch.Tensor, index: int) -> torch.Tensor:
    """New device storage holding a copy of a host tensor (dense strides kept)."""
    if not discrete():
        return _C.device_copy_of(host, index)
    device = torch.device("neuron", index)
    if _dense(host):
        out = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)
    else:
        out = torch.empty(host.shape, dtype=host.dtype, device=device)
        host = host.contiguous()
    if host.numel() == 0:
        return out
    start, end = _span(host)  # dense: the same strides cover [0, end - start) of the new storage
    write_bytes(index, _storage_address(out), _bytes(host.untyped_storage(), start, end))
    return out


__all__ = [
    "copy_addresses",
    "device_copy_of",
    "reset_transfer_stats",
    "stage",
    "to_host",
    "transfer_stats",
    "write_back",
    "write_into",
]
