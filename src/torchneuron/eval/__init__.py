"""Evaluation: conformance against PyTorch's OpInfo database (`conformance`),
the shape registry of op signatures from real runs (`registry`), tests
generated from it (`unit`) and the staged runner (`stages`)."""

from .registry import record_shapes

__all__ = ["record_shapes"]
