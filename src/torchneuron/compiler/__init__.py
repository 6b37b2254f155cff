"""MLIR -> IREE executable (.vmfb): target flags, compile errors, a bounded pool."""

from .iree_compile import (CompileError, compile_mlir, compiler_version, says_nothing_about_the_module, target_flags,
                           target_known)
from .pool import CompilePool, compile_pool

__all__ = ["CompileError", "CompilePool", "compile_mlir", "compile_pool", "compiler_version",
           "says_nothing_about_the_module", "target_flags", "target_known"]
