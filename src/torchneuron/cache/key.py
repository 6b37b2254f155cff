"""The cache key of an executable (see DESIGN.md, "Cache key")."""

from __future__ import annotations

import hashlib

# Version of the calling convention between the runtime and executables
# (inputs, then outputs written in place, async fences). Bump when it changes.
ENTRY_ABI = "neuron-eager-1"


def cache_key(mlir: str, backend: str, flags: tuple) -> str:
    """SHA-256 over the canonical MLIR text, compiler version, target, code-changing
    flags, torchneuron version and the entry ABI."""
    from .. import __version__
    from ..compiler import compiler_version

    h = hashlib.sha256()
    for part in (
        "mlir", mlir,
        "compiler", compiler_version(),
        "backend", backend,
        "flags", "\0".join(flags),
        "torchneuron", __version__,
        "abi", ENTRY_ABI,
    ):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()
