"""The neuron device: registration with PyTorch and the `torch.neuron` module."""

from __future__ import annotations

import atexit
import os

import torch

from .. import _C, config
from . import hal, module

# What the default (llvm-cpu) target holds. A dtype outside this set fails at
# allocation with a clear error rather than deep inside a kernel.
SUPPORTED_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)

_registered = False


def _device_was_used() -> bool:
    return any(_C.memory_stats(i)["num_allocs"] > 0 for i in range(_C.device_count()))


def _after_fork_in_child() -> None:
    # As with CUDA: a child forked from a process that used the device cannot use it.
    if _device_was_used() or module.is_initialized():
        _C.mark_bad_fork()
        from ..dispatch import entry

        entry.unusable_reason = module.BAD_FORK


def _apply_setting(name, value) -> None:
    if name == "device_count":
        _C.set_device_count(int(value))
    elif name == "memory_limit_mb":
        for i in range(_C.device_count()):
            _C.set_memory_limit(i, int(value) * 1024 * 1024)
    elif name == "check_memory":
        _C.enable_memory_guards(bool(value))
    elif name == "driver":
        hal.available_drivers.cache_clear()
        _C.mark_unusable(hal.driver_problem(value) or "")


def _shutdown() -> None:
    # IREE objects must go before the interpreter tears its modules down.
    from .. import runtime
    from ..cache import executable_cache
    from ..dispatch import eager

    runtime.queue.shutdown()
    eager.reset()
    executable_cache().clear()
    hal.release_devices()


def register() -> None:
    """Make "neuron" a PyTorch device. Idempotent; run by `import torch` (autoload)."""
    global _registered
    if _registered:
        return
    from ..dispatch import entry

    _C.set_device_count(config.settings.device_count)
    _C.set_supported_dtypes(list(SUPPORTED_DTYPES))
    torch.utils.rename_privateuse1_backend("neuron")
    torch._register_device_module("neuron", module)
    torch.utils.generate_methods_for_privateuse1_backend(
        for_tensor=True, for_module=True, for_packed_sequence=True, for_storage=True
    )
    from .. import runtime
    from ..runtime import streams  # noqa: F401 - installs the guard's stream and event calls

    entry.install()
    _C.set_synchronize_callback(runtime.synchronize)
    atexit.register(_shutdown)
    from ..eval import registry

    registry.start_from_environment()  # TORCHNEURON_RECORD_SHAPES
    os.register_at_fork(after_in_child=_after_fork_in_child)
    for name in ("memory_limit_mb", "driver", "check_memory"):
        _apply_setting(name, getattr(config.settings, name))
    config.on_change(_apply_setting)
    _registered = True
