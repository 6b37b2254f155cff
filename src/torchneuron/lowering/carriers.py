"""Integer tensors an executable writes in place are bound as floats of the
same width.

IREE 3.13 cannot compile a module that reads an integer argument it also
overwrites (torch-iree-func-conversion leaves an unresolved si32 -> i32 cast),
so every in-place op on an integer tensor used to run on the host. Bound as a
float "carrier" of the same width and bit-cast back to the integer type inside
the module, the same bytes compile and run on the device; nothing computes on
the carrier's values, so no bit pattern changes.
"""

from __future__ import annotations

import torch

_CARRIERS = {
    torch.int64: torch.float64,
    torch.int32: torch.float32,
    torch.int16: torch.float16,
    torch.int8: torch.float8_e4m3fn,
    torch.uint8: torch.float8_e4m3fn,
}


def carrier_dtypes(specs, mutated) -> dict:
    """{tensor input index: the dtype it is bound as} for the integer inputs a
    call writes in place; empty for most calls."""
    return {i: _CARRIERS[specs[i].dtype] for i in mutated if specs[i].dtype in _CARRIERS}


def as_integer(carrier: torch.Tensor, dtype) -> torch.Tensor:
    """The integer view of a carrier input (writes through it reach the input).
    A 0-d bitcast crashes IREE's compiler; one of shape (1,) compiles."""
    if carrier.dim() == 0:
        return carrier.reshape(1).view(dtype).reshape(())
    return carrier.view(dtype)
