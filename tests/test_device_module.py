"""torch.neuron, torchneuron and torch.accelerator (issue item 3)."""

import os

import pytest
import torch

import torchneuron


def test_device_module_functions():
    assert torch.neuron.is_available()
    assert torch.neuron.device_count() == 2
    assert torch.neuron.current_device() == 0
    torch.neuron.set_device(1)
    assert torch.neuron.current_device() == 1
    assert torch.empty(1, device="neuron").device == torch.device("neuron:1")
    torch.neuron.set_device("neuron:0")
    with torch.neuron.device(1):
        assert torch.neuron.current_device() == 1
        assert torch.ones(1, device="neuron").device.index == 1
    assert torch.neuron.current_device() == 0
    torch.neuron.synchronize()
    torch.neuron.synchronize(1)
    assert torch.neuron.get_amp_supported_dtype() == [torch.float16, torch.bfloat16]
    # The same functions on the package.
    assert torchneuron.device_count is torch.neuron.device_count or torchneuron.device_count() == 2


def test_accelerator_api():
    assert torch.accelerator.is_available()
    assert torch.accelerator.current_accelerator() == torch.device("neuron")
    assert torch.accelerator.device_count() == 2
    torch.accelerator.set_device_index(1)
    assert torch.accelerator.current_device_index() == 1
    torch.accelerator.set_device_index(0)
    torch.accelerator.synchronize()
    s = torch.accelerator.current_stream()
    assert s.device == torch.device("neuron:0")


def test_accelerator_memory_functions_read_the_neuron_allocator():
    # torch.accelerator's memory functions (vLLM's loader and workers call
    # them) reach neuron's allocator as they reach CUDA's.
    torch.accelerator.empty_cache()
    before = torch.accelerator.memory_allocated(1)
    assert before == torch.neuron.memory_allocated(1)
    torch.accelerator.reset_peak_memory_stats(1)
    x = torch.empty(1 << 20, dtype=torch.uint8, device="neuron:1")
    assert torch.accelerator.memory_allocated(1) == before + (1 << 20) == torch.neuron.memory_allocated(1)
    assert torch.accelerator.max_memory_allocated(1) == before + (1 << 20)
    stats = torch.accelerator.memory_stats(1)
    assert stats["allocated_bytes.all.current"] == before + (1 << 20)
    assert stats["allocation.all.current"] == torch.neuron.memory_stats(1)["allocation.all.current"]
    del x
    assert torch.accelerator.memory_allocated(1) == before
    assert torch.accelerator.max_memory_allocated(1) == before + (1 << 20)
    torch.accelerator.reset_peak_memory_stats(1)
    assert torch.accelerator.max_memory_allocated(1) == before
    free, total = torch.accelerator.get_memory_info(1)
    assert (free, total) == torch.neuron.mem_get_info(1) and 0 < free <= total
    try:  # with a limit the device is that big
        torch.neuron.set_memory_limit(before + (64 << 20), 1)
        torch.accelerator.empty_cache()
        assert torch.accelerator.get_memory_info(1) == (64 << 20, before + (64 << 20))
    finally:
        torch.neuron.set_memory_limit(0, 1)
    pinned = torch.ones(100).pin_memory()
    torch.accelerator.empty_host_cache()  # neuron's host allocator: nothing cached, nothing lost
    assert pinned.is_pinned() and pinned.sum().item() == 100


def test_streams_and_events():
    s = torch.Stream(device="neuron")
    assert s.device_type == torch._C._autograd.DeviceType.PrivateUse1 or s.device.type == "neuron"
    with torch.neuron.stream(s):
        assert torch.neuron.current_stream() == s
    assert torch.neuron.current_stream() == torch.neuron.default_stream()
    start = torch.Event(device="neuron", enable_timing=True)
    end = torch.Event(device="neuron", enable_timing=True)
    start.record()
    y = torch.randn(64, 64, device="neuron") @ torch.randn(64, 64, device="neuron")
    end.record()
    end.synchronize()
    assert end.query()
    assert start.elapsed_time(end) >= 0.0
    assert y.shape == (64, 64)


def test_seeding_matches_cpu():
    torch.manual_seed(123)
    a = torch.randn(5, device="neuron")
    torch.manual_seed(123)
    b = torch.randn(5)
    torch.testing.assert_close(a.cpu(), b)
    torch.neuron.manual_seed(7)
    assert torch.neuron.initial_seed() == 7
    state = torch.neuron.get_rng_state()
    x = torch.rand(3, device="neuron")
    torch.neuron.set_rng_state(state)
    y = torch.rand(3, device="neuron")
    torch.testing.assert_close(x.cpu(), y.cpu())
    torch.neuron.manual_seed_all(5)
    states = torch.neuron.get_rng_state_all()
    assert len(states) == 2 and torch.equal(states[0], states[1])
    torch.neuron.seed()
    assert torch.neuron.initial_seed() != 5


def test_device_generators():
    g = torch.Generator(device="neuron")
    assert g.device == torch.device("neuron:0")
    g.manual_seed(3)
    a = torch.randn(4, device="neuron", generator=g)
    g.manual_seed(3)
    b = torch.randn(4, device="neuron", generator=g)
    torch.testing.assert_close(a.cpu(), b.cpu())
    torch.testing.assert_close(a.cpu(), torch.randn(4, generator=torch.Generator().manual_seed(3)))
    with pytest.raises(RuntimeError, match="Expected a 'neuron' device type for generator"):
        torch.randn(4, device="neuron", generator=torch.Generator())


def test_dropout_randomness_matches_cpu():
    x = torch.ones(1000)
    torch.manual_seed(1)
    a = torch.nn.functional.dropout(x.neuron(), 0.5)
    torch.manual_seed(1)
    b = torch.nn.functional.dropout(x, 0.5)
    torch.testing.assert_close(a.cpu(), b)


@pytest.mark.parametrize("workers", [1, 3])
def test_device_workers_setting_sizes_the_task_pool(workers):
    """TORCHNEURON_DEVICE_WORKERS sets the worker threads of IREE's task pool
    (default: one per core); work on the pool gives CPU's results."""
    import subprocess
    import sys

    code = (
        "import os, torch, torchneuron\n"
        "torch.manual_seed(0)\n"
        "a = torch.randn(512, 512)\n"
        "got = (a.neuron() @ a.neuron()).cpu()\n"  # large: runs on the task pool
        "torch.testing.assert_close(got, a @ a, rtol=1e-4, atol=1e-3)\n"
        "names = [open(f'/proc/self/task/{t}/comm').read() for t in os.listdir('/proc/self/task')]\n"
        "print(sum(n.startswith('iree-worker') for n in names))\n"
    )
    # the task pool is the local-task driver's (the suite may run on another driver)
    env = dict(os.environ, TORCHNEURON_DEVICE_WORKERS=str(workers), TORCHNEURON_DRIVER="local-task")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == str(workers)
