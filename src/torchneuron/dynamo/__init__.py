"""torch.compile(backend="neuron"): whole forward and backward graphs on the
same lowering, compiler, cache layers and runtime as eager mode.

Registered with TorchDynamo through the `torch_dynamo_backends` entry point
(so `torch._dynamo.list_backends()` lists it without importing torchneuron)
and again when torchneuron is imported.
"""

from __future__ import annotations

from . import flex_attention
from .backend import GraphCompileError, neuron


_INTERNALS = ("adaptive", "cache", "compiler", "config", "device", "dispatch", "distributed", "dynamo", "lowering",
              "memory", "profiler", "runtime", "service", "trace")


def register() -> None:
    from torch._dynamo import trace_rules
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    if "neuron" not in _COMPILER_FNS:
        register_backend(name="neuron")(neuron)
    # Dynamo never traces the backend's own frames: eager ops that run while
    # a compiled frame is active (a graph break, a fallback) reach the
    # dispatcher's Python code, which Dynamo would otherwise try to compile.
    # (torchneuron.models stays traceable: it is a user model, the demo's.)
    for name in _INTERNALS:
        trace_rules.add(f"torchneuron.{name}")
    flex_attention.allow_neuron()


__all__ = ["GraphCompileError", "neuron", "register"]
