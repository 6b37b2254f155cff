"""What the lowering knows of its target: whether its code is IREE's CPU
codegen or a GPU's (Vulkan's SPIR-V, CUDA, ROCm). A few ops lower
differently on GPU targets, where PyTorch's own kernels compute them
differently or IREE's GPU code for them was wrong (rules/float32_moments.py,
rules/depthwise_taps.py, rules/long_scans.py). The lowering worker is started with the process's
driver (worker.py), and a cache key holds the lowered program, so the two
never mix."""

from __future__ import annotations

from .. import config

# IREE's CPU drivers; every other driver runs GPU code.
CPU_DRIVERS = ("local-task", "local-sync")


def gpu_target() -> bool:
    return config.settings.driver not in CPU_DRIVERS
