"""Lowering: an aten op call (later: a graph) -> one functional FX graph ->
torch-dialect MLIR through IREE's FX importer. One module for every mode."""

from .call import CallSignature, NotCompilable, signature_of
from .graph import LoweredCall, NeedsResize, lower_call

__all__ = ["CallSignature", "LoweredCall", "NeedsResize", "NotCompilable", "lower_call", "signature_of"]
