"""The dtypes a neuron storage can hold on the default (llvm-cpu) target.

A dtype outside this set fails at allocation with a clear error (csrc's
allocator checks it) rather than deep inside a kernel."""

import torch

SUPPORTED_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
    torch.float8_e8m0fnu,
)
