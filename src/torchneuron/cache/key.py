"""Cache keys (docs/architecture.md, "Compiling once: the cache layers").

An executable's key is the SHA-256 of its components: the canonical MLIR text
(by its hash), the compiler version, the target, every flag that changes code
(among them the CPU's name and feature list, spelled out: never "host"), the
torchneuron version and the entry ABI. The components are stored with each
entry, so `torchneuron cache explain` can say why two keys differ.

A plan id names the lowering of one op signature. Lowering is code, not data,
so the id also covers a fingerprint of torchneuron's own sources and torch's
version: editing the lowering invalidates plans, never executables.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os

# Version of the calling convention between the runtime and executables
# (inputs, then outputs written in place, async fences). Bump when it changes.
ENTRY_ABI = "neuron-eager-2"  # 2: read-only inputs protected from in-place updates


def key_components(mlir: str, backend: str, flags: tuple) -> dict:
    from ..version import __version__
    from ..compiler import compiler_version
    from ..compiler.target_cpu import cpu_of_flags

    # The CPU as its own fields (also inside the flags), so `cache explain`
    # names it; taken from the flags, so whoever compiles (a compile service
    # on another machine) computes the same key without resolving anything.
    cpu, features = cpu_of_flags(flags)
    return {
        "mlir_sha256": hashlib.sha256(mlir.encode()).hexdigest(),
        "compiler": compiler_version(),
        "backend": backend,
        "flags": list(flags),
        "target_cpu": cpu,
        "target_cpu_features": features,
        "torchneuron": __version__,
        "abi": ENTRY_ABI,
    }


def key_of(components: dict) -> str:
    return hashlib.sha256(json.dumps(components, sort_keys=True).encode()).hexdigest()


def cache_key(mlir: str, backend: str, flags: tuple) -> str:
    return key_of(key_components(mlir, backend, flags))


@functools.cache
def code_fingerprint() -> str:
    """Hash of torchneuron's Python sources and the versions that shape lowering."""
    import torch

    from ..compiler import compiler_version

    h = hashlib.sha256(f"torch {torch.__version__}\0iree {compiler_version()}\0".encode())
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                h.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


def plan_id(signature_key: tuple, backend: str, flags: tuple) -> str | None:
    """A stable id for an op signature's plan; None when the signature has no
    stable text form (it then is planned in memory only)."""
    text = repr(signature_key)
    if " at 0x" in text:
        return None
    h = hashlib.sha256()
    for part in (code_fingerprint(), backend, "\0".join(flags), ENTRY_ABI, text):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()
