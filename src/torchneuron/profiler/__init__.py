"""Profiling: the device's work in torch.profiler.

`torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1])`
records each launch on the device (executable, stream, start and end, the CPU
op that issued it and the user's source line) through the kineto plugin in
csrc/profiler.cpp, which calls `recorder`. `export_parquet` writes a profile
as Parquet tables.
"""

from . import recorder  # noqa: F401 - installs the plugin's Python side
from .export import export_parquet

__all__ = ["export_parquet"]
