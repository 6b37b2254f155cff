"""Checking guarded memory (TORCHNEURON_CHECK_MEMORY=1; csrc/memory_guards.cpp).

After each launch in this mode the runtime waits for it and checks every
allocation's guard bytes and the poison of recently freed blocks, so an op
that writes outside the memory it was given is named with its shapes and the
user's source line, instead of corrupting the heap for a later crash.
"""

from __future__ import annotations

from .. import _C
from .errors import NeuronAsyncError

# Every this many launches the check after a launch covers every block, not
# only the launch's own: a write into unrelated memory is still found soon.
_FULL_EVERY = 32
_launches = 0


class NeuronMemoryError(NeuronAsyncError):
    """An op wrote outside the memory it owns (found by the memory guards)."""


def _describe(violation) -> str:
    address, nbytes, device, where, offset = violation
    return (f"a {nbytes}-byte allocation at 0x{address:x} on neuron:{device} "
            f"was written {where} (first changed byte at offset {offset})")


def verify(what: str, source: str, thorough: bool = False) -> None:
    """Raise NeuronMemoryError if any guard or poison changed since the last
    check. Quick (after a launch): every guard and the start of each freed
    block; thorough (at a sync): all of each freed block too."""
    violations = _C.check_memory_guards(thorough)
    if violations:
        _raise(what, source, violations)


def _raise(what: str, source: str, violations) -> None:
    if violations:
        details = "; ".join(_describe(v) for v in violations[:4])
        more = f" (and {len(violations) - 4} more)" if len(violations) > 4 else ""
        raise NeuronMemoryError(
            f"neuron: {what} (issued at {source}) wrote outside the memory it owns: {details}{more}. "
            "Found by TORCHNEURON_CHECK_MEMORY=1."
        )


def verify_launch(what: str, source: str, keepalive) -> None:
    """After a launch: the guards of the memory it was given (where an
    overflow lands), and every _FULL_EVERY launches all of them."""
    global _launches
    _launches += 1
    if _launches % _FULL_EVERY == 0:
        return verify(what, source)
    violations = _C.check_memory_guards_at([t.data_ptr() for t in _tensors(keepalive) if t.device.type != "cpu"])
    if violations:
        _raise(what, source, violations)


def _tensors(value):
    if hasattr(value, "data_ptr"):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
