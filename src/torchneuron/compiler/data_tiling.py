"""Data tiling only where it pays: for modules whose matmuls are large.

IREE's data tiling packs matmul operands into tiled layouts. Measured on
llvm-cpu (emeraldrapids, 2 cores, one executable per matmul, medians), it
pays only for large matmuls: at 1024x1024x1024 it made the matmul 2.8x
faster (15.1 ms against 42.9 ms), at 512x512x512 it was even (8.0 ms both),
and below that it cost 10-60% (256x64x256: 0.20 ms against 0.15 ms; a
32-batch 32x16x32 bmm: 0.12 ms against 0.03 ms). It also fails to compile
some modules that have a small batched matmul feeding a broadcasting
consumer (IREE 3.13: "'iree_codegen.load_from_buffer' op buffer and tensor
shapes must be compatible", the attention scores of the demo GPT), which cost
a failed compile before the retry without it. So a module whose largest
matmul is below the threshold is compiled without data tiling.
"""

from __future__ import annotations

import math
import re

ON = "--iree-opt-data-tiling=true"
OFF = "--iree-opt-data-tiling=false"

# Multiply-accumulates of the largest matmul from which data tiling is kept:
# between the measured break-even (2^27) and the first clear win (2^30).
THRESHOLD_MACS = 1 << 28

_MATMUL = re.compile(
    r"= torch\.aten\.(mm|bmm|matmul|addmm|baddbmm|linear|_scaled_mm) [^:]*:\s*(.*?)\s*->\s*"
    r"!torch\.vtensor<\[([^\]]*)\]"
)
_OPERAND = re.compile(r"!torch\.vtensor<\[([^\]]*)\]")
# Which operand holds the reduced dimension last: addmm's and baddbmm's first is the bias.
_LHS = {"addmm": 1, "baddbmm": 1}


def largest_matmul_macs(mlir: str) -> float:
    """Multiply-accumulates of the module's largest matmul (0: none; inf: a
    dynamic size, so it may be large): the result's elements times the
    reduced dimension (the left operand's last)."""
    largest = 0.0
    for op, operands, result in _MATMUL.findall(mlir):
        types = _OPERAND.findall(operands)
        lhs = _LHS.get(op, 0)
        if len(types) <= lhs:
            continue
        dims = [*_dims(types[lhs])[-1:], *_dims(result)]
        largest = max(largest, math.inf if None in dims else float(math.prod(dims)))
    return largest


def _dims(text: str) -> list:
    return [None if d.strip() == "?" else int(d) for d in text.split(",") if d.strip()]


def for_module(mlir: str, target: tuple) -> tuple:
    """The target to compile this module for: the same, or without data
    tiling when the target asks for it and every matmul is small."""
    if ON not in target[1] or largest_matmul_macs(mlir) >= THRESHOLD_MACS:
        return target
    return without(target)


def without(target: tuple):
    """The target with data tiling off, or None when it is not on; for a
    module that data tiling fails to compile (whatever its matmuls)."""
    backend, flags = target
    if ON not in flags:
        return None
    return backend, tuple(OFF if f == ON else f for f in flags)


__all__ = ["THRESHOLD_MACS", "for_module", "largest_matmul_macs", "without"]
