"""Lowering: an aten op call (call.py, graph.py), a recorded graph of them
(fused.py) or a torch.compile graph -> one functional FX graph with
torchneuron's decompositions (decompositions.py over rules/) -> torch-dialect
MLIR through IREE's FX importer. One lowering for every mode."""

from .call import CallSignature, NotCompilable, WritesSharedMemory, signature_of
from .graph import LoweredCall, NeedsResize, lower_call

__all__ = ["CallSignature", "LoweredCall", "NeedsResize", "NotCompilable", "WritesSharedMemory", "lower_call",
           "signature_of"]
