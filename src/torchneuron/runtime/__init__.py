"""Loading executables on HAL devices and launching them asynchronously."""

from .errors import NeuronAsyncError, user_source_line
from .executable import LoadedExecutable
from .queue import DeviceQueue, device_queue, synchronize, synchronize_all

__all__ = [
    "DeviceQueue",
    "LoadedExecutable",
    "NeuronAsyncError",
    "device_queue",
    "synchronize",
    "synchronize_all",
    "user_source_line",
]
