import os

# Two neuron devices, so cross-device behaviour is tested; set before torch loads.
os.environ.setdefault("TORCHNEURON_DEVICE_COUNT", "2")

import pytest  # noqa: E402
import torch  # noqa: E402

import torchneuron  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_settings():
    """Each test starts with the default fallback policy and no memory limit."""
    saved = torchneuron.config.as_dict()
    yield
    torch.neuron.synchronize()
    torchneuron.config.set(
        fallback=saved["fallback"],
        memory_limit_mb=saved["memory_limit_mb"],
        execution=saved["execution"],
        launch_blocking=saved["launch_blocking"],
    )
    torch.neuron.set_device(0)


def assert_same(neuron_value, cpu_value, **tol):
    """A neuron result equals the CPU result (values, dtype, shape)."""
    assert isinstance(neuron_value, torch.Tensor)
    assert neuron_value.device.type == "neuron", neuron_value.device
    torch.testing.assert_close(neuron_value.cpu(), cpu_value, **tol)
