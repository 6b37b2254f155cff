"""Storages, exact allocation statistics, the memory limit and zero-copy IREE aliases (item 4)."""

import gc

import pytest
import torch

import torchneuron
from torchneuron.memory import from_buffer_view, to_buffer_view


def test_real_storage():
    x = torch.empty(3, 5, device="neuron")
    assert x.data_ptr() != 0
    assert x.untyped_storage().nbytes() == 60
    assert x.data_ptr() % 64 == 0
    assert x.untyped_storage().device == torch.device("neuron:0")


def test_allocation_stats_are_exact():
    gc.collect()
    base = torch.neuron.memory_allocated()
    torch.neuron.reset_peak_memory_stats()
    a = torch.empty(1000, dtype=torch.float32, device="neuron")
    assert torch.neuron.memory_allocated() == base + 4000
    b = torch.empty(10, dtype=torch.int8, device="neuron")
    assert torch.neuron.memory_allocated() == base + 4010
    del a
    assert torch.neuron.memory_allocated() == base + 10
    assert torch.neuron.max_memory_allocated() == base + 4010
    torch.neuron.reset_peak_memory_stats()
    assert torch.neuron.max_memory_allocated() == base + 10
    stats = torch.neuron.memory_stats()
    assert stats["allocated_bytes.all.current"] == base + 10
    del b
    assert torch.neuron.memory_allocated() == base


def test_stats_are_per_device():
    base0 = torch.neuron.memory_allocated(0)
    base1 = torch.neuron.memory_allocated("neuron:1")
    x = torch.empty(256, device="neuron:1")
    assert torch.neuron.memory_allocated(1) == base1 + 1024
    assert torch.neuron.memory_allocated(0) == base0
    del x


def test_out_of_memory_names_sizes_and_loses_nothing():
    keep = torch.arange(10.0, device="neuron")
    base = torch.neuron.memory_allocated()
    # Tensors other tests on this worker still hold count too: the limit leaves 1-2 MiB above them.
    torchneuron.config.set(memory_limit_mb=base // 2**20 + 2)
    with pytest.raises(torch.OutOfMemoryError, match=r"Tried to allocate 3\.00 MiB.*already allocated"):
        torch.empty(768 * 1024, device="neuron")
    assert torch.neuron.memory_stats()["num_ooms"] >= 1
    # The failed allocation left the counters and existing tensors as they were.
    assert torch.neuron.memory_allocated() == base
    torch.testing.assert_close(keep.cpu(), torch.arange(10.0))
    small = torch.empty(1000, device="neuron")  # under the limit: fine
    del small
    torchneuron.config.set(memory_limit_mb=0)
    big = torch.empty(512 * 1024, device="neuron")
    assert big.numel() == 512 * 1024


@pytest.mark.unified_memory
def test_hal_buffer_view_aliases_storage():
    x = torch.arange(12, dtype=torch.float32, device="neuron").reshape(3, 4)
    view = to_buffer_view(x)
    assert tuple(view.shape) == (3, 4)
    host = from_buffer_view(view)
    assert host.data_ptr() == x.data_ptr()
    x.add_(1)  # written through torch (asynchronously) ...
    torch.neuron.synchronize()
    assert host[2, 3].item() == 12.0  # ... seen through IREE's buffer
    with pytest.raises(ValueError, match="contiguous"):
        to_buffer_view(x.t())


def test_output_allocation_refuses_a_dtype_the_target_cannot_hold():
    from torchneuron import _C

    assert _C.empty((2, 3), torch.float32, 0).shape == (2, 3)
    with pytest.raises(TypeError, match="ComplexHalf cannot be held by the current target"):
        _C.empty((2,), torch.complex32, 0)


@pytest.mark.parametrize("mode", ["op", "adaptive"])
def test_storage_resize_keeps_the_device_and_waits_for_pending_work(mode):
    """FSDP2 frees a parameter's memory with `untyped_storage().resize_(0)` and
    regrows it before the next all-gather. A storage shrunk to nothing stays a
    neuron storage; one regrown holds what queued or recorded ops wrote first;
    memory comes from the storage's own device, not the current one."""
    torchneuron.set_eager_mode(mode)
    x = torch.arange(1 << 20, dtype=torch.float32)
    on1 = x.to("neuron:1")
    y = on1 * 2 + 1  # queued (op mode) or pending in a graph (adaptive)
    storage = y.untyped_storage()
    storage.resize_(storage.nbytes() + 64)  # grows: the old contents are copied
    assert storage.device == torch.device("neuron:1")
    assert torch.equal(y.cpu(), x * 2 + 1)
    assert torch.equal(on1.cpu(), x)  # the input is untouched

    z = on1 + 3
    z.untyped_storage().resize_(0)
    assert z.untyped_storage().device == torch.device("neuron:1")
    assert z.untyped_storage().nbytes() == 0
    z.untyped_storage().resize_(x.numel() * 4)
    z.copy_(on1 - 1)
    assert torch.equal((z * 2).cpu(), (x - 1) * 2)
    assert torch.neuron.current_device() == 0
