"""The neuron kernel language: tile-level kernels in Python (`import
torchneuron.kernel as nk`), traced to MLIR, compiled and cached like every
executable, launched on neuron tensors, and simulated on NumPy. See
docs/kernels.md."""

from .custom_op import op
from .jit import Kernel, jit, simulate
from .language import *  # noqa: F403
from .language import __all__ as _language

__all__ = ["Kernel", "jit", "op", "simulate", *_language]
