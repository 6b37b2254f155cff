"""Profiling: the device's work in torch.profiler.

`torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1])`
records each launch on the device (executable, stream, start and end, the CPU
op that issued it and the user's source line) through the kineto plugin in
csrc/profiler.cpp, which calls `recorder`.
"""

from . import recorder  # noqa: F401 - installs the plugin's Python side
