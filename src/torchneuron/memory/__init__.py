"""Device memory: statistics, the per-device limit and zero-copy IREE aliases."""

from .stats import (
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
from .hal_alias import from_buffer_view, to_buffer_view

__all__ = [
    "empty_cache",
    "from_buffer_view",
    "max_memory_allocated",
    "memory_allocated",
    "mem_get_info",
    "memory_limit",
    "memory_reserved",
    "memory_stats",
    "reset_peak_memory_stats",
    "set_memory_limit",
    "to_buffer_view",
]
