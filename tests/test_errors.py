"""Wrong device mixes, bad device indices, use after fork (item 10)."""

import multiprocessing as mp
import subprocess
import sys

import pytest
import torch


def test_mixed_devices_error_like_cuda():
    n = torch.randn(3, 3, device="neuron")
    c = torch.randn(3, 3)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        n + c
    with pytest.raises(RuntimeError, match=r"but got mat2 is on cpu, different from other tensors on neuron:0"):
        torch.mm(n, c)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        n + torch.randn(3, 3, device="neuron:1")
    # 0-dim CPU tensors are scalars, as on CUDA; indexing with host indices works.
    torch.testing.assert_close((n * torch.tensor(2.0)).cpu(), n.cpu() * 2)
    torch.testing.assert_close(n[torch.tensor([0, 2])].cpu(), n.cpu()[[0, 2]])


def test_bad_device_index():
    with pytest.raises(IndexError, match=r"Invalid neuron device index 5: there are 2 neuron devices"):
        torch.empty(2, device="neuron:5")
    with pytest.raises(IndexError, match="Invalid neuron device index 7"):
        torch.neuron.set_device(7)
    with pytest.raises(IndexError, match="Invalid neuron device index"):
        torch.ones(2).to("neuron:3")


def _child_uses_device(queue):
    try:
        torch.ones(2, device="neuron")
        queue.put("no error")
    except RuntimeError as e:
        queue.put(str(e))


def test_use_after_fork_says_use_spawn():
    torch.ones(1, device="neuron")  # the parent has used the device
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child_uses_device, args=(q,))
    p.start()
    msg = q.get(timeout=60)
    p.join(timeout=60)
    assert "Cannot re-initialize neuron in forked subprocess" in msg
    assert "'spawn' start method" in msg


def test_spawned_child_can_use_device():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child_uses_device, args=(q,))
    p.start()
    assert q.get(timeout=120) == "no error"
    p.join(timeout=60)


def _first_tensor_on(driver: str) -> str:
    """What a program on `driver` prints: the error of its first tensor."""
    code = (
        "import torch\n"
        "assert not torch.neuron.is_available()\n"
        "try:\n"
        "    torch.ones(2, device='neuron')\n"
        "except RuntimeError as e:\n"
        "    print(e)\n"
        "else:\n"
        "    print('allocated')\n"
    )
    env = dict(__import__("os").environ, TORCHNEURON_DRIVER=driver)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_driver_without_a_device_is_refused_at_once():
    # IREE's runtime carries the cuda driver; this machine has no GPU. The
    # program hears it at its first tensor, naming the driver and what failed,
    # not at a first launch after ops ran on the host path while compiling.
    said = _first_tensor_on("cuda")
    assert "'cuda'" in said and "cannot be used" in said and "local-task" in said, said


def test_unavailable_driver_names_available_ones():
    said = _first_tensor_on("no-such-driver")
    assert "'no-such-driver'" in said and "local-task" in said, said
