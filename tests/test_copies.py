"""Copies between host and devices, host reads, serialization (item 5)."""

import copy
import io
import pickle

import pytest
import torch


def test_cpu_to_neuron_and_back():
    x = torch.randn(4, 5)
    n = x.to("neuron")
    assert n.device == torch.device("neuron:0")
    torch.testing.assert_close(n.cpu(), x)
    # Non-contiguous sources and destinations.
    torch.testing.assert_close(x.t().to("neuron").cpu(), x.t())
    torch.testing.assert_close(n.t().cpu(), x.t())
    d = torch.zeros(5, 4, device="neuron")
    d.copy_(x.t())
    torch.testing.assert_close(d.cpu(), x.t())


def test_neuron_to_neuron_across_devices():
    x = torch.randn(3, 3)
    a = x.to("neuron:0")
    b = a.to("neuron:1")
    assert b.device == torch.device("neuron:1")
    assert b.data_ptr() != a.data_ptr()
    torch.testing.assert_close(b.cpu(), x)
    c = a.clone()
    assert c.device == a.device and c.data_ptr() != a.data_ptr()
    z = torch.zeros(3, 3, device="neuron:1")
    z.copy_(a)
    torch.testing.assert_close(z.cpu(), x)


def test_non_blocking():
    x = torch.randn(100)
    n = x.to("neuron", non_blocking=True)
    back = n.to("cpu", non_blocking=True)
    torch.neuron.synchronize()
    torch.testing.assert_close(back, x)


def test_pinned_memory_and_non_blocking_copies():
    x = torch.randn(300)
    pinned = x.pin_memory()
    assert pinned.is_pinned() and not x.is_pinned() and torch.equal(pinned, x)
    n = pinned.to("neuron", non_blocking=True)
    back = torch.empty(300, pin_memory=True)
    back.copy_(n * 2, non_blocking=True)
    torch.neuron.current_stream().synchronize()
    torch.testing.assert_close(back, x * 2)
    torch.testing.assert_close(pinned, x)  # the source is unchanged
    part = torch.empty(100, pin_memory=True)
    part.copy_(n[100:200], non_blocking=True)  # an offset into the device storage
    torch.neuron.synchronize()
    torch.testing.assert_close(part, x[100:200])


def test_pinned_memory_exhausted_is_an_out_of_memory_error():
    with pytest.raises(torch.OutOfMemoryError, match="pinned host memory"):
        torch.empty(2**50, dtype=torch.uint8, pin_memory=True)  # a PiB: more than the address space
    assert torch.empty(8, pin_memory=True).is_pinned()  # and the allocator goes on


def test_host_reads():
    n = torch.tensor([[1.5, 2.0], [3.0, 4.0]], device="neuron")
    assert n[0, 0].item() == 1.5
    assert n.tolist() == [[1.5, 2.0], [3.0, 4.0]]
    assert "device='neuron:0'" in repr(n)
    assert "1.5000" in str(n)
    assert bool(n.sum() > 10)
    assert int(torch.tensor(7, device="neuron")) == 7


def test_numpy_fails_like_cuda():
    with pytest.raises(TypeError, match="can't convert neuron:0 device type tensor to numpy"):
        torch.ones(2, device="neuron").numpy()


def test_save_and_load():
    x = torch.randn(3, 4)
    state = {"w": x.to("neuron"), "b": torch.arange(3, device="neuron:1")}
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf)
    assert loaded["w"].device == torch.device("neuron:0")
    assert loaded["b"].device == torch.device("neuron:1")
    torch.testing.assert_close(loaded["w"].cpu(), x)
    buf.seek(0)
    on_cpu = torch.load(buf, map_location="cpu")
    assert on_cpu["w"].device.type == "cpu"
    torch.testing.assert_close(on_cpu["w"], x)
    buf.seek(0)
    moved = torch.load(buf, map_location={"neuron:1": "neuron:0"})
    assert moved["b"].device == torch.device("neuron:0")
    # CPU checkpoint loaded onto neuron.
    buf = io.BytesIO()
    torch.save({"w": x}, buf)
    buf.seek(0)
    assert torch.load(buf, map_location="neuron")["w"].device.type == "neuron"


def test_module_state_dict_round_trip():
    m = torch.nn.Linear(4, 2).to("neuron")
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    buf.seek(0)
    m2 = torch.nn.Linear(4, 2).to("neuron")
    m2.load_state_dict(torch.load(buf))
    torch.testing.assert_close(m2.weight.cpu(), m.weight.cpu())


def test_pickle_and_deepcopy():
    x = torch.randn(5, device="neuron")
    y = pickle.loads(pickle.dumps(x))
    assert y.device == x.device
    torch.testing.assert_close(y.cpu(), x.cpu())
    z = copy.deepcopy(x)
    assert z.device == x.device and z.data_ptr() != x.data_ptr()
    torch.testing.assert_close(z.cpu(), x.cpu())
    m = copy.deepcopy(torch.nn.Linear(2, 2).to("neuron"))
    assert m.weight.device.type == "neuron"
