"""Whether a cached executable was compiled for the target asked for.

Keys cover the target's flags, so an entry under a key was compiled for it,
unless the entry was planted or copied there (`cache import`, a shared
directory, a remote store). An IREE module names the target of each of its
executables in its own bytes (`#hal.executable.target<"backend", ..., {cpu =
..., features = ...}>`, what its load error would print): read them, and an
entry for another backend, CPU or GPU feature set is refused before a device
tries to load it. A module with no executables names no target, and runs on
any device.
"""

from __future__ import annotations

import re

_TARGET = re.compile(rb'#hal\.executable\.target<"([\w-]+)", "[\w-]+", \{([^>]*)')
_FEATURES = rb'features = "([^"]*)"'
_FIELD = {
    # flag -> (what it is, the field of the embedded target that records it)
    "--iree-llvmcpu-target-cpu=": ("CPU", rb'cpu = "([^"]*)"'),
    # (a device target written out in full: its own features field)
    "--iree-hal-target-device=": ("Vulkan features", _FEATURES),
}


def _wanted(flag: str, prefix: str, field: bytes) -> str | None:
    value = flag[len(prefix):]
    if prefix == "--iree-hal-target-device=":
        found = re.search(field, value.encode())
        return found.group(1).decode() if found else None
    return value


def mismatch(vmfb: bytes, backend: str, flags: tuple) -> str | None:
    """Why `vmfb` was not compiled for (backend, flags), or None."""
    for found_backend, details in _TARGET.findall(vmfb):
        found = found_backend.decode()
        if found != backend:
            return f"compiled for {found}, not {backend}"
        for flag in flags:
            for prefix, (name, field) in _FIELD.items():
                if flag.startswith(prefix):
                    recorded = re.search(field, details)
                    wanted = _wanted(flag, prefix, field)
                    if recorded is not None and wanted is not None and recorded.group(1).decode() != wanted:
                        return f"compiled for {name} {recorded.group(1).decode()!r}, not {wanted!r}"
    return None
