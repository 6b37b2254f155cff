"""Operators that run as themselves, never inside a lowered graph: kernels
written in the kernel language (torchneuron.kernel) are executables of
their own. A torch.compile graph that calls one is cut around the call
(dynamo/pieces.py). So are collectives (torch.distributed's functional ops):
they run through the process group between the graph's compiled pieces, in
the order the graph gives them."""

from __future__ import annotations

_names: set = set()
_namespaces: set = set()


def register_opaque(qualified_name: str) -> None:
    """`namespace::name` runs as itself in every graph."""
    _names.add(qualified_name)


def register_opaque_namespace(namespace: str) -> None:
    """Every operator of `namespace` runs as itself in every graph."""
    _namespaces.add(namespace)


def is_opaque(target) -> bool:
    schema = getattr(target, "_schema", None)
    return schema is not None and (schema.name in _names or schema.name.split("::", 1)[0] in _namespaces)


__all__ = ["is_opaque", "register_opaque", "register_opaque_namespace"]
