"""The C++ dispatch entry (csrc/recording.cpp): calls like one Python already
took (a cached launch in op mode, a recipe in adaptive eager) are taken in
C++. Each learned call must still be the call it stands for: its constants,
the layout and alignment of its tensors, its runtime numbers."""

import pytest
import torch

import torchneuron
from torchneuron import _C


@pytest.fixture(params=["op", "adaptive"])
def mode(request):
    torchneuron.config.set(compile_wait=True)  # fused and per-op executables from the first call
    with torchneuron.eager_mode(request.param):
        yield request.param


def _repeat(fn, *args, times=4):
    """fn's results over several calls: later calls take the learned path."""
    out = None
    for _ in range(times):
        out = fn(*args)
        torch.neuron.synchronize()
    return out


def test_learned_calls_are_taken_in_cpp(mode):
    x = torch.randn(16, device="neuron")
    _repeat(lambda t: t + t, x)
    learned = _C.known_calls()
    assert learned > 0
    torchneuron.reset_stats()
    for _ in range(5):
        y = x * 3.0
    torch.neuron.synchronize()
    # Counted as every call is, whichever path took it.
    assert torchneuron.op_counts()["aten.mul.Tensor"] == 5
    torch.testing.assert_close(y.cpu(), x.cpu() * 3.0)


def test_constants_are_part_of_a_learned_call(mode):
    a = torch.randn(5, 7)
    x = a.to("neuron")
    for _ in range(3):
        for dim in (0, 1, 0, -1):
            torch.testing.assert_close(x.sum(dim).cpu(), a.sum(dim))
        for alpha in (1, 2, 1, 0.5):
            torch.testing.assert_close(torch.add(x, x, alpha=alpha).cpu(), torch.add(a, a, alpha=alpha))
        torch.testing.assert_close(x.cpu(), a)


def test_runtime_numbers_change_between_learned_calls(mode):
    a = torch.randn(8)
    x = a.to("neuron")
    for k in range(6):
        scale = 0.5 + k
        torch.testing.assert_close((x * scale + k).cpu(), a * scale + k)


@pytest.mark.parametrize("case", ["float", "int", "bool", "reflected", "int tensor"])
def test_python_numbers_in_tensor_arguments_are_taken_in_cpp(mode, case):
    """`x * 0.5` reaches the dispatcher with 0.5 as a "wrapped number" tensor,
    and a Python kernel with 0.5 as a Python float: the C++ entry takes it
    apart as that number (it once could not learn such calls at all, and
    every one went through Python)."""
    a = torch.arange(12, dtype=torch.int64 if case == "int tensor" else torch.float32) - 5
    fns = {
        "float": lambda t, k: t * (0.5 + k),
        "int": lambda t, k: t + (k + 2),
        "bool": lambda t, k: t * (k % 2 == 0),
        "reflected": lambda t, k: (1.5 + k) - t,
        "int tensor": lambda t, k: t * (k + 3),
    }
    fn = fns[case]
    x = a.to("neuron")
    _repeat(lambda t: fn(t, 0), x)
    _C.forget_calls(None)
    for k in range(6):
        torch.testing.assert_close(fn(x, k).cpu(), fn(a, k))
    assert _C.known_calls() > 0
    torch.testing.assert_close(x.cpu(), a)


def test_views_at_every_offset_get_their_own_data(mode):
    """Same shape and strides, different offsets: misaligned views are
    imported by the span around them, so their alignment is in the key."""
    base = torch.arange(64, dtype=torch.float32)
    x = base.to("neuron")
    for _ in range(2):
        for offset in (0, 1, 16, 3, 0, 5):
            torch.testing.assert_close((x[offset:offset + 32] * 2).cpu(), base[offset:offset + 32] * 2)
        for offset in (0, 2, 1):
            torch.testing.assert_close(x[offset::2][:16].exp().cpu(), base[offset::2][:16].exp())
    torch.testing.assert_close(x.cpu(), base)


def test_in_place_learned_calls_write_only_their_target(mode):
    a = torch.randn(4, 6)
    b = torch.randn(4, 6)
    x, y = a.to("neuron"), b.to("neuron")
    for _ in range(4):
        x.add_(y, alpha=0.25)
        a.add_(b, alpha=0.25)
    torch.testing.assert_close(x.cpu(), a)
    torch.testing.assert_close(y.cpu(), b)


def test_dtypes_and_devices_are_part_of_a_learned_call(mode):
    a = torch.randn(6)
    for _ in range(3):
        for dtype in (torch.float32, torch.float64, torch.float32):
            x = a.to("neuron", dtype)
            torch.testing.assert_close((x + 1).cpu(), a.to(dtype) + 1)
        for index in (0, 1, 0):
            x = a.to(f"neuron:{index}")
            y = x + 1
            assert y.device == x.device
            torch.testing.assert_close(y.cpu(), a + 1)


def test_a_forgotten_op_is_not_taken(mode):
    x = torch.randn(8, device="neuron")
    _repeat(lambda t: t - 1, x)
    assert _C.known_calls() > 0
    _C.forget_calls(None)
    assert _C.known_calls() == 0
    torch.testing.assert_close((x - 1).cpu(), x.cpu() - 1)
