"""Checking guarded memory (TORCHNEURON_CHECK_MEMORY=1; csrc/memory_guards.cpp).

After each launch in this mode the runtime waits for it and checks every
allocation's guard bytes and the poison of recently freed blocks, so an op
that writes outside the memory it was given is named with its shapes and the
user's source line, instead of corrupting the heap for a later crash.
"""

from __future__ import annotations

from .. import _C
from .errors import NeuronAsyncError


class NeuronMemoryError(NeuronAsyncError):
    """An op wrote outside the memory it owns (found by the memory guards)."""


def _describe(violation) -> str:
    address, nbytes, device, where, offset = violation
    return (f"a {nbytes}-byte allocation at 0x{address:x} on neuron:{device} "
            f"was written {where} (first changed byte at offset {offset})")


def verify(what: str, source: str) -> None:
    """Raise NeuronMemoryError if any guard or poison changed since the last check."""
    violations = _C.check_memory_guards()
    if violations:
        details = "; ".join(_describe(v) for v in violations[:4])
        more = f" (and {len(violations) - 4} more)" if len(violations) > 4 else ""
        raise NeuronMemoryError(
            f"neuron: {what} (issued at {source}) wrote outside the memory it owns: {details}{more}. "
            "Found by TORCHNEURON_CHECK_MEMORY=1."
        )
