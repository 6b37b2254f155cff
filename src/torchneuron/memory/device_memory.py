"""Device buffers behind storages on the discrete memory model.

There a storage's data_ptr() is an opaque device address (csrc/
device_addresses.cpp hands them out); the memory behind it is a device-local
buffer from the HAL device's allocator, made here at first use of the block
and let go once the allocator released the block. An executable binds a
tensor as a buffer view over part of its block: IREE's Python bindings have
no subspan, so the view is made by a tiny VM module of the HAL's own
`hal.buffer_view.create` (one function per rank), compiled once per
process. The host never maps these buffers: it reaches them only through
transfers (runtime/transfers.py).
"""

from __future__ import annotations

import ctypes
import math
import threading
from collections import Counter

import numpy as np

import torch

from .. import _C, config
from ..hal.devices import hal_device

_MAX_RANK = 8
# The HAL target each driver's helper module is compiled for: the module has
# no executables, but it names the device it runs on.
_HELPER_TARGETS = {"local-task": "llvm-cpu", "local-sync": "llvm-cpu", "vulkan": "vulkan-spirv",
                   "cuda": "cuda", "hip": "rocm"}
_MAX_VIEWS_PER_BLOCK = 256
# Guarded memory's guard byte (csrc/memory_guards.cpp: 0xFD) as a 4-byte fill pattern.
_GUARD_WORD = np.array([0xFDFDFDFD], np.uint32)


def _helper_source() -> str:
    functions = []
    for rank in range(_MAX_RANK + 1):
        dims = "".join(f", %d{i}: index" for i in range(rank))
        shape = ", ".join(f"%d{i}" for i in range(rank))
        functions.append(
            f"util.func public @view{rank}(%b: !hal.buffer, %off: index, %len: index, %t: i32{dims}) "
            "-> !hal.buffer_view {\n"
            "  %enc = arith.constant 1 : i32\n"
            f"  %v = hal.buffer_view.create buffer(%b : !hal.buffer)[%off, %len] shape([{shape}]) "
            "type(%t) encoding(%enc) : !hal.buffer_view\n"
            "  util.return %v : !hal.buffer_view\n}\n"
        )
    return "".join(functions)


class _Block:
    __slots__ = ("buffer", "length", "views")

    def __init__(self, buffer, length: int):
        self.buffer = buffer
        self.length = length
        self.views: dict = {}  # (offset, shape, dtype) -> HalBufferView


class FlagCopy:
    """A launch's index flag copied to host memory, once its timeline has
    passed the copy (DeviceMemory.copy_out)."""

    __slots__ = ("staging", "nbytes", "dtype")

    def __init__(self, staging, nbytes: int, dtype: torch.dtype):
        self.staging, self.nbytes, self.dtype = staging, nbytes, dtype

    def host(self) -> torch.Tensor:
        data = self.staging.map().asarray((self.nbytes,), np.dtype(np.uint8)).copy()
        return torch.from_numpy(data).view(self.dtype)


class DeviceMemory:
    """The device buffers of one neuron device's storages."""

    def __init__(self, index: int, vm_instance, element_types: dict):
        import iree.runtime as ireert

        self._rt = ireert
        self.index = index
        self.device = hal_device(index)
        self.element_types = element_types
        self.blocks: dict = {}  # block start address -> _Block
        self._memory_type = int(ireert.MemoryType.DEVICE_LOCAL)
        self._usage = int(ireert.BufferUsage.DEFAULT)
        self._context, self._view_functions = self._load_helper(vm_instance)
        self._empty = None  # a small buffer empty tensors are bound to

    def _load_helper(self, vm_instance):
        import iree.compiler as compiler

        driver = config.settings.driver
        binary = compiler.compile_str(
            _helper_source(), target_backends=[_HELPER_TARGETS.get(driver, "llvm-cpu")]
        )
        rt = self._rt
        module = rt.VmModule.copy_buffer(vm_instance, binary)
        context = rt.VmContext(vm_instance, [rt.create_hal_module(vm_instance, self.device), module])
        return context, [module.lookup_function(f"view{rank}") for rank in range(_MAX_RANK + 1)]

    def block(self, address: int) -> tuple:
        """(block, offset of `address` in it) for a live device address."""
        start, length = _C.device_block_of(address)
        if length == 0:
            raise RuntimeError(f"neuron: {address:#x} is not a live address of neuron:{self.index}'s memory")
        block = self.blocks.get(start)
        if block is None or block.length != length:
            with _lock:  # one buffer per block, whichever thread meets it first
                let_go_of_released()
                block = self.blocks.get(start)
                if block is None or block.length != length:
                    buffer = self._allocate(length)
                    if config.settings.check_memory:
                        # guarded memory: the block's guards (around the storage) start as guard bytes
                        self._run_now(lambda commands: commands.fill(buffer, _GUARD_WORD, 0, length))
                    block = self.blocks[start] = _Block(buffer, length)
        return block, address - start

    def _allocate(self, length: int):
        try:
            return self.device.allocator.allocate_buffer(
                memory_type=self._memory_type, allowed_usage=self._usage, allocation_size=length
            )
        except Exception as e:  # noqa: BLE001 - IREE says RESOURCE_EXHAUSTED in a RuntimeError
            raise torch.OutOfMemoryError(
                f"neuron out of memory: the device memory of neuron:{self.index} "
                f"(driver {config.settings.driver}) could not hold a further {length} bytes: {e}"
            ) from e

    def view_at(self, address: int, shape: tuple, dtype: torch.dtype):
        """A buffer view over `shape` elements of `dtype` at a device address."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            return self._empty_view(shape, dtype)
        start, length = _C.device_block_of(address)
        if length == 0:
            # Host memory: a CPU tensor an op takes beside neuron ones (a CPU
            # index, a 0-d scalar). The launch keeps it alive; the device
            # reads a copy of its bytes.
            host = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))
            count("host_to_device", nbytes)
            return self._rt.HalBufferView(self.staging_with(host), shape, self.element_types[dtype])
        block, offset = self.block(address)
        key = (offset, shape, dtype)
        view = block.views.get(key)
        if view is not None:
            return view
        rt = self._rt
        if len(shape) > _MAX_RANK:
            raise RuntimeError(f"neuron: a tensor of rank {len(shape)} cannot be bound (at most {_MAX_RANK})")
        args = rt.VmVariantList(4 + len(shape))
        args.push_ref(block.buffer)
        args.push_int(offset)
        args.push_int(nbytes)
        args.push_int(int(self.element_types[dtype]))
        for d in shape:
            args.push_int(d)
        results = rt.VmVariantList(1)
        self._context.invoke(self._view_functions[len(shape)], args, results)
        view = results.get_as_object(0, rt.HalBufferView)
        if len(block.views) >= _MAX_VIEWS_PER_BLOCK:
            del block.views[next(iter(block.views))]
        block.views[key] = view
        return view

    def _empty_view(self, shape, dtype):
        if self._empty is None:
            self._empty = self._allocate(256)
        return self._rt.HalBufferView(self._empty, shape, self.element_types[dtype])

    def _run_now(self, record) -> None:
        """Record commands with `record(command_buffer)` and run them at
        once, outside any timeline: for memory no queued work uses."""
        commands = self._rt.HalCommandBuffer(self.device)
        record(commands)
        commands.end()
        self._execute_now(commands)

    def _execute_now(self, commands) -> None:
        rt = self._rt
        semaphore = self.device.create_semaphore(0)
        self.device.queue_execute(commands, rt.HalFence(0), rt.HalFence.create_at(semaphore, 1))
        semaphore.wait(1)

    def copy_out(self, address: int, nbytes: int, dtype: torch.dtype) -> tuple:
        """(command buffer, FlagCopy): commands that copy `nbytes` at a device
        address to host memory, for a timeline to queue after the launch that
        writes them (a launch's index flag: runtime/queue.py)."""
        buffer, offset = self.buffer_at(address)
        staging = self.staging_for_reading(nbytes)
        commands = self._rt.HalCommandBuffer(self.device)
        commands.copy(buffer, staging, offset, 0, nbytes, end=True)
        count("device_to_host", nbytes)
        count("index_checks", nbytes)
        return commands, FlagCopy(staging, nbytes, dtype)

    def read_now(self, address: int, nbytes: int) -> np.ndarray:
        """Copy `nbytes` at a device address to the host at once, outside any
        timeline: for memory whose writer is known done (a finished launch's
        index flag)."""
        commands, copy = self.copy_out(address, nbytes, torch.uint8)
        self._execute_now(commands)
        return copy.host().numpy()

    def read_regions(self, regions: list) -> list:
        """The bytes of each (address, length) in one submission (guarded
        memory's checks: runtime/memory_guards.py)."""
        places = [self.buffer_at(address) for address, _ in regions]
        total = sum(length for _, length in regions)
        staging = self.staging_for_reading(max(total, 1))

        def record(commands):
            at = 0
            for (buffer, offset), (_, length) in zip(places, regions):
                commands.copy(buffer, staging, offset, at, length)
                at += length

        self._run_now(record)
        count("device_to_host", total)
        count("memory_guards", total)
        data = staging.map().asarray((max(total, 1),), np.dtype(np.uint8)).copy()
        out, at = [], 0
        for _, length in regions:
            out.append(data[at:at + length])
            at += length
        return out

    def write_regions(self, regions: list) -> None:
        """Fill each (address, length, byte value) in one submission: copies
        from a host buffer of the bytes, as fills need 4-byte alignment on
        some targets (Vulkan) and guards start anywhere."""
        places = [self.buffer_at(address) for address, _, _ in regions]
        data = np.concatenate([np.full(length, value, np.uint8) for _, length, value in regions])
        staging = self.staging_with(data)

        def record(commands):
            at = 0
            for (buffer, offset), (_, length, _) in zip(places, regions):
                commands.copy(staging, buffer, at, offset, length)
                at += length

        self._run_now(record)
        count("host_to_device", len(data))
        count("memory_guards", len(data))

    def staging_for_reading(self, nbytes: int):
        """A host buffer the device can copy into and the host can map."""
        rt = self._rt
        return self.device.allocator.allocate_buffer(
            memory_type=int(rt.MemoryType.HOST_LOCAL | rt.MemoryType.DEVICE_VISIBLE),
            allowed_usage=int(rt.BufferUsage.TRANSFER_TARGET | rt.BufferUsage.MAPPING_SCOPED),
            allocation_size=nbytes,
        )

    def staging_with(self, data: np.ndarray):
        """A host buffer holding a copy of `data` that the device can read."""
        rt = self._rt
        return self.device.allocator.allocate_buffer_copy(
            memory_type=int(rt.MemoryType.HOST_LOCAL | rt.MemoryType.DEVICE_VISIBLE),
            allowed_usage=int(rt.BufferUsage.DEFAULT | rt.BufferUsage.MAPPING_SCOPED),
            device=self.device,
            buffer=data,
        )

    def import_pinned(self, start: int, size: int):
        """A pinned host block (csrc/pinned_memory.cpp: page-aligned, whole
        pages) as a buffer the device copies to and from in place. Imported
        for each copy, not cached: the block may be freed and its pages
        unmapped once the copy is done."""
        rt = self._rt
        host = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(start))
        return self.device.allocator.import_host_allocation(
            host,
            int(rt.MemoryType.HOST_LOCAL | rt.MemoryType.DEVICE_VISIBLE),
            int(rt.BufferUsage.TRANSFER | rt.BufferUsage.DISPATCH_STORAGE),
        )

    def buffer_at(self, address: int) -> tuple:
        """(HalBuffer, byte offset) of a live device address: what transfers copy to and from."""
        block, offset = self.block(address)
        return block.buffer, offset



_lock = threading.Lock()
_memories: dict = {}  # device index -> DeviceMemory
_counts: Counter = Counter()  # bytes and copies each way (runtime/transfers.py reports them)
_count_lock = threading.Lock()


def count(kind: str, nbytes: int) -> None:
    with _count_lock:
        _counts[kind] += nbytes
        _counts[f"{kind}_copies"] += 1


def counts() -> dict:
    with _count_lock:
        return dict(_counts)


def reset_counts() -> None:
    with _count_lock:
        _counts.clear()


def device_memory(index: int, vm_instance, element_types: dict) -> DeviceMemory:
    memory = _memories.get(index)
    if memory is None:
        with _lock:
            memory = _memories.get(index)
            if memory is None:
                memory = _memories[index] = DeviceMemory(index, vm_instance, element_types)
    return memory


def existing(index: int) -> DeviceMemory:
    """The device memory of neuron:index, once the device has been used."""
    memory = _memories.get(index)
    if memory is None:
        raise RuntimeError(f"neuron:{index} has no device memory in use yet")
    return memory


def in_use(index: int) -> DeviceMemory | None:
    """The device memory of neuron:index, or None before the device's first use."""
    return _memories.get(index)


def let_go_of_released() -> None:
    """Drop the buffers of blocks the allocator released, unless the same
    block is live again (addresses are one space over every device)."""
    for start, _ in _C.take_released_blocks():
        live = _C.device_block_of(start)
        for memory in _memories.values():
            block = memory.blocks.get(start)
            if block is not None and live != (start, block.length):
                del memory.blocks[start]


def release_all() -> None:
    with _lock:
        _memories.clear()
