"""Operators that run as themselves, never inside a lowered graph: kernels
written in the kernel language (torchneuron.kernel) are executables of
their own. A torch.compile graph that calls one is cut around the call
(dynamo/pieces.py)."""

from __future__ import annotations

_names: set = set()


def register_opaque(qualified_name: str) -> None:
    """`namespace::name` runs as itself in every graph."""
    _names.add(qualified_name)


def is_opaque(target) -> bool:
    schema = getattr(target, "_schema", None)
    return schema is not None and schema.name in _names


__all__ = ["is_opaque", "register_opaque"]
