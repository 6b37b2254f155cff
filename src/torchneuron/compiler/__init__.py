"""MLIR -> IREE executable (.vmfb): target flags, compile errors, a bounded pool."""

from .iree_compile import CompileError, NotCompilable, compile_mlir, target_flags, target_known
from .pool import CompilePool, compile_pool
from .tool import compiler_version, says_nothing_about_the_module

__all__ = ["CompileError", "CompilePool", "NotCompilable", "compile_mlir", "compile_pool", "compiler_version",
           "says_nothing_about_the_module", "target_flags", "target_known"]
