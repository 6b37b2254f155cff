"""The padded sizes a serving step's shapes take.

On a compile-first device every new shape is a new executable. Padding each
size vLLM varies from step to step (tokens in the batch, the longest query,
the blocks of the longest context) up to a power of two bounds the
executables a server ever compiles to a few per size, all reused across
requests and, through the disk cache, across restarts.
"""

from __future__ import annotations


def bucket(n: int, cap: int | None = None) -> int:
    """The power of two at or above n (at least 1), but never above cap
    (cap itself when it is smaller: the largest batch vLLM schedules)."""
    size = 1 << max(0, int(n) - 1).bit_length()
    return size if cap is None else max(int(n), min(size, int(cap)))
