"""Every supported dtype round-trips and computes like CPU; others fail clearly (item 6)."""

import pytest
import torch

import torchneuron

DTYPES = [
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8,
    torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128,
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_and_compute(dtype):
    if dtype == torch.bool:
        x = torch.tensor([True, False, True, True])
    elif dtype.is_floating_point or dtype.is_complex:
        x = torch.randn(4, 3, dtype=dtype)
    else:
        x = torch.randint(0, 100, (4, 3)).to(dtype)
    n = x.to("neuron")
    assert n.dtype == dtype
    torch.testing.assert_close(n.cpu(), x)
    if dtype == torch.bool:
        torch.testing.assert_close((n & ~n.roll(1)).cpu(), x & ~x.roll(1))
    else:
        torch.testing.assert_close((n * 2 + n).cpu(), x * 2 + x)
        if dtype.is_complex:
            torch.testing.assert_close(n.abs().max().cpu(), x.abs().max())
        else:
            torch.testing.assert_close(n.max().cpu(), x.max())


FLOAT8 = [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
          torch.float8_e8m0fnu]  # storage and casts only, as on CPU (tests/test_float8.py)


def test_supported_dtypes_listed():
    assert set(torchneuron.supported_dtypes()) == set(DTYPES + FLOAT8)


@pytest.mark.parametrize("dtype", [torch.complex32, torch.uint16, torch.uint32, torch.float4_e2m1fn_x2], ids=str)
def test_unsupported_dtype_fails_clearly(dtype):
    with pytest.raises(TypeError, match="cannot be held by the current target"):
        torch.zeros(3, dtype=dtype, device="neuron")
    with pytest.raises(TypeError, match="cannot be held by the current target"):
        torch.zeros(3, dtype=dtype).to("neuron")
