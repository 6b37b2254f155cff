"""The composition root: makes "neuron" a PyTorch device and wires the layers
together (the one place that knows them all).

`register()` runs once, from the package's __init__ (and so from `import
torch`, through the autoload entry point): the device's name and module,
the dispatcher entry, the runtime's synchronize and stream calls, shape
recording from the environment, at-fork and at-exit handling, the settings
that reach the C++ glue, then the surfaces over the device: the c10d
backend, the profiler's device events (TORCHNEURON_PROFILER) and the
torch.compile backend.
"""

from __future__ import annotations

import atexit
import os

import torch

from . import _C, config, runtime
from .cache import executable_cache
from .device import module
from .dispatch import eager, entry, shape_recording
from .hal import devices as hal
from .memory.dtypes import SUPPORTED_DTYPES
from .runtime import streams  # noqa: F401 - installs the guard's stream and event calls
from .runtime import transfers

_registered = False


def _device_was_used() -> bool:
    return any(_C.memory_stats(i)["num_allocs"] > 0 for i in range(_C.device_count()))


def _after_fork_in_child() -> None:
    # As with CUDA: a child forked from a process that used the device cannot use it.
    if _device_was_used() or module.is_initialized():
        _C.mark_bad_fork()
        entry.unusable_reason = module.BAD_FORK


def _apply_setting(name, value) -> None:
    if name == "device_count":
        _C.set_device_count(int(value))
    elif name == "memory_limit_mb":
        for i in range(_C.device_count()):
            _C.set_memory_limit(i, int(value) * 1024 * 1024)
    elif name == "check_memory":
        _C.enable_memory_guards(bool(value))
    elif name in ("driver", "memory"):
        hal.available_drivers.cache_clear()
        _C.mark_unusable(hal.driver_problem(config.settings.driver) or hal.memory_problem() or "")
        _C.set_discrete_memory(hal.memory_model_in_use() == "discrete")


def _shutdown() -> None:
    # IREE objects must go before the interpreter tears its modules down.
    runtime.queue.shutdown()
    eager.reset()
    executable_cache().clear()
    hal.release_devices()


def register() -> None:
    """Make "neuron" a PyTorch device. Idempotent."""
    global _registered
    if _registered:
        return
    _C.set_device_count(config.settings.device_count)
    _C.set_supported_dtypes(list(SUPPORTED_DTYPES))
    torch.utils.rename_privateuse1_backend("neuron")
    torch._register_device_module("neuron", module)
    torch.utils.generate_methods_for_privateuse1_backend(
        for_tensor=True, for_module=True, for_packed_sequence=True, for_storage=True
    )
    entry.install()
    _C.set_synchronize_callback(runtime.synchronize)
    atexit.register(_shutdown)
    shape_recording.start_from_environment()  # TORCHNEURON_RECORD_SHAPES
    os.register_at_fork(after_in_child=_after_fork_in_child)
    _C.set_device_copy_callback(transfers.copy_addresses)
    for name in ("memory_limit_mb", "driver", "check_memory"):
        _apply_setting(name, getattr(config.settings, name))
    config.on_change(_apply_setting)
    _registered = True
    _register_surfaces()


def _register_surfaces() -> None:
    from . import distributed, dynamo
    from .libraries import lightning

    distributed.register()  # the c10d backend
    if config.settings.profiler:
        from . import profiler  # noqa: F401 - torch.profiler's device events
    dynamo.register()  # torch.compile(backend="neuron")
    lightning.register_when_imported()  # Trainer(accelerator="neuron"), when Lightning is imported
