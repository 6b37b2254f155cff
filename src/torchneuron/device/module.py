"""`torch.neuron`: the device module, with the functions torch.cuda users expect."""

from __future__ import annotations

import typing

import torch

from .. import _C
from ..hal import devices as hal
from ..hal.index import device_index
from ..memory import (  # noqa: F401 - re-exported as torch.neuron.*
    empty_cache,
    max_memory_allocated,
    memory_allocated,
    mem_get_info,
    memory_limit,
    memory_reserved,
    memory_stats,
    reset_peak_memory_stats,
    set_memory_limit,
)
from ..runtime.generators import (  # noqa: F401 - re-exported as torch.neuron.*
    default_generators,
    get_rng_state,
    get_rng_state_all,
    initial_seed,
    manual_seed,
    manual_seed_all,
    seed,
    seed_all,
    set_rng_state,
    set_rng_state_all,
)

_initialized = False
_PRIVATEUSE1 = 20  # c10::DeviceType::PrivateUse1
_POOL_SIZE = 32  # streams per priority (csrc/guard.cpp): ids above it are high priority


class Stream(torch.Stream):
    """A neuron stream: its own ordered timeline on the device, ordered
    against other streams only by events and waits (runtime/queue.py).

    As on CUDA, `Stream()` hands out streams from a pool of 32 per priority
    round robin. `priority` < 0 takes a high-priority stream; IREE's CPU task
    system has no queue priorities, so it is kept apart and reported, not
    scheduled first."""

    def __new__(cls, device=None, priority: int = 0, **kwargs):
        if kwargs:  # torch.Stream(stream_id=, device_index=, device_type=)
            return super().__new__(cls, **kwargs)
        index = device_index(device)
        return super().__new__(cls, device=torch.device("neuron", index), priority=priority)

    @property
    def priority(self) -> int:
        return -1 if self.stream_id > _POOL_SIZE else 0

    def __enter__(self):
        self._previous = current_stream(self.device_index)
        set_stream(self)
        return self

    def __exit__(self, *exc):
        set_stream(self._previous)
        return False


def _as_neuron_stream(stream: torch.Stream) -> Stream:
    return Stream(stream_id=stream.stream_id, device_index=stream.device_index, device_type=_PRIVATEUSE1)


class _NeuronEventType(type):
    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, torch.Event) and obj.device.type == "neuron"


class Event(metaclass=_NeuronEventType):
    """A neuron event (a `torch.Event`): a point on one stream's timeline.
    `wait` orders a stream after it on the device; `elapsed_time` is measured
    between the times the device reached two timed events. `blocking` is
    accepted: a host wait always blocks (the CPU target has nothing to spin on).

    Made as a plain torch.Event (torch's own methods accept no subclass)."""

    def __new__(cls, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        return torch.Event(device="neuron", enable_timing=enable_timing, blocking=blocking,
                           interprocess=interprocess)



def _is_in_bad_fork() -> bool:
    return _C.in_bad_fork()


BAD_FORK = (
    "Cannot re-initialize neuron in forked subprocess. To use neuron with "
    "multiprocessing, you must use the 'spawn' start method "
    "(multiprocessing.set_start_method('spawn'))."
)


def _lazy_init() -> None:
    """Create the HAL devices; raises with the reason if neuron cannot be used."""
    global _initialized
    if _initialized:
        return
    if _C.in_bad_fork():
        raise RuntimeError(BAD_FORK)
    for i in range(_C.device_count()):
        hal.hal_device(i)
    _initialized = True


def is_initialized() -> bool:
    return _initialized


def init() -> None:
    _lazy_init()


def is_available() -> bool:
    from .. import config

    return not _C.in_bad_fork() and hal.driver_problem(config.settings.driver) is None


def device_count() -> int:
    return _C.device_count()


def current_device() -> int:
    return _C.current_device()


def set_device(device) -> None:
    _C.set_device(device_index(device))


class device:
    """Context manager that makes `device` the current neuron device."""

    def __init__(self, device):
        self.idx = -1 if device is None else device_index(device)
        self.prev_idx = -1

    def __enter__(self):
        if self.idx >= 0:
            self.prev_idx = _C.current_device()
            _C.set_device(self.idx)
        return self

    def __exit__(self, *exc):
        if self.idx >= 0:
            _C.set_device(self.prev_idx)
        return False


class device_of(device):
    """Context manager that makes the device of tensor `obj` current."""

    def __init__(self, obj):
        super().__init__(obj.device.index if obj.device.type == "neuron" else None)


def synchronize(device=None) -> None:
    """Wait for all work queued on the device."""
    torch.accelerator.synchronize(device_index(device))


def current_stream(device=None) -> Stream:
    return _as_neuron_stream(torch.accelerator.current_stream(device_index(device)))


def default_stream(device=None) -> Stream:
    # Stream id 0 is each device's default stream (csrc/guard.cpp).
    return Stream(stream_id=0, device_index=device_index(device), device_type=_PRIVATEUSE1)


def set_stream(stream: torch.Stream) -> None:
    torch.accelerator.set_stream(stream)


def stream(stream: torch.Stream | None):
    """Context manager that makes `stream` current (None: no change)."""
    import contextlib

    if stream is None:
        return contextlib.nullcontext()
    return _as_neuron_stream(stream) if type(stream) is not Stream else stream


def get_amp_supported_dtype() -> list:
    return [torch.float16, torch.bfloat16]


def get_device_name(device=None) -> str:
    """"neuron (IREE <driver>)", with the device's own name where the driver
    has one (a GPU; Vulkan's lavapipe: "llvmpipe (...)")."""
    from .. import config
    from ..hal import devices

    names = devices.device_names(config.settings.driver)
    if not names:
        return f"neuron (IREE {config.settings.driver})"
    # neuron:i is physical device i; indices beyond them share them in turn (hal/devices.py)
    return f"neuron (IREE {config.settings.driver}: {names[device_index(device) % len(names)]})"


class DeviceProperties(typing.NamedTuple):
    """What torch.cuda.get_device_properties gives that applies here: the
    device's name and total memory (libraries size batches and device maps
    from it), and its driver, index and memory model ("unified": host memory;
    "discrete": memory of its own, reached through transfers)."""

    name: str
    total_memory: int
    driver: str
    index: int
    memory_model: str


def get_device_properties(device=None) -> DeviceProperties:
    from .. import config
    from ..hal import devices

    index = device_index(device)
    return DeviceProperties(get_device_name(index), mem_get_info(index)[1], config.settings.driver, index,
                            devices.memory_model_in_use())


def is_bf16_supported(including_emulation: bool = True) -> bool:
    """bfloat16 runs on every neuron target (Transformers' `bf16=True` and
    Accelerate's mixed precision ask this, as of torch.cuda)."""
    return True
