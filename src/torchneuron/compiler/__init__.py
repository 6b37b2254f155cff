"""MLIR -> IREE executable (.vmfb): target flags, compile errors, a bounded pool."""

from .iree_compile import CompileError, compile_mlir, compiler_version, target_flags, target_known
from .pool import CompilePool, compile_pool

__all__ = ["CompileError", "CompilePool", "compile_mlir", "compile_pool", "compiler_version", "target_flags", "target_known"]
