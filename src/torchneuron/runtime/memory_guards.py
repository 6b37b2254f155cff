"""Checking guarded memory (TORCHNEURON_CHECK_MEMORY=1; csrc/memory_guards.cpp).

On the discrete memory model the guards and poison are device memory: they
are written when a block's device buffer is made (memory/device_memory.py)
and here, and read here, with counted transfers.

After each launch in this mode the runtime waits for it and checks every
allocation's guard bytes and the poison of recently freed blocks, so an op
that writes outside the memory it was given is named with its shapes and the
user's source line, instead of corrupting the heap for a later crash.
"""

from __future__ import annotations

from collections import defaultdict

from .. import _C
from ..memory import device_memory
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
    violations = _check(None, thorough)
    if violations:
        _raise(what, source, violations)


def _check(addresses, thorough: bool) -> list:
    """The violations among the guards of the blocks at `addresses` (None:
    of every block, and the poison of freed ones)."""
    if not _C.discrete_memory():
        return _C.check_memory_guards(thorough) if addresses is None else _C.check_memory_guards_at(addresses)
    # The discrete model: the guards are device memory, read with transfers,
    # one submission a device; a changed region is reported once, then restored.
    poison_freed()
    by_device = defaultdict(list)
    for region in _C.guard_regions(addresses, thorough):
        if region[5]:  # an empty allocation's poison has no bytes
            by_device[region[2]].append(region)
    violations = []
    for device, regions in by_device.items():
        memory = device_memory.in_use(device)
        if memory is None:
            continue  # nothing ran on the device yet: its blocks have no memory to write
        changed = []
        for region, data in zip(regions, memory.read_regions([(r[4], r[5]) for r in regions])):
            address, nbytes, _, where, start, length, value, offset = region
            wrong = (data != value).nonzero()[0]
            if len(wrong):
                violations.append((address, nbytes, device, where, offset + int(wrong[0])))
                changed.append((start, length, value))
        if changed:
            memory.write_regions(changed)
    return violations


def poison_freed() -> None:
    """Fill the blocks freed since the last device work with poison (the
    discrete model: the host cannot write them as it frees them)."""
    if not _C.discrete_memory():
        return
    by_device = defaultdict(list)
    for _, _, device, _, start, length, value, _ in _C.take_blocks_to_poison():
        if length:
            by_device[device].append((start, length, value))
    for device, regions in by_device.items():
        memory = device_memory.in_use(device)
        if memory is not None:
            memory.write_regions(regions)


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
    violations = _check([t.data_ptr() for t in _tensors(keepalive) if t.device.type != "cpu"], False)
    if violations:
        _raise(what, source, violations)


def _tensors(value):
    if hasattr(value, "data_ptr"):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
