import os

# Two neuron devices, so cross-device behaviour is tested; set before torch loads.
os.environ.setdefault("TORCHNEURON_DEVICE_COUNT", "2")
# A fresh persistent cache per session, so counts of compiles are the same on
# every run (TORCHNEURON_TEST_CACHE_DIR reuses one across runs, for speed).
if "TORCHNEURON_TEST_CACHE_DIR" in os.environ:
    os.environ["TORCHNEURON_CACHE_DIR"] = os.environ["TORCHNEURON_TEST_CACHE_DIR"]
else:
    import tempfile

    os.environ["TORCHNEURON_CACHE_DIR"] = tempfile.mkdtemp(prefix="torchneuron-test-cache-")
    _SESSION_CACHE = os.environ["TORCHNEURON_CACHE_DIR"]
os.environ.pop("TORCHNEURON_COMPILE_SERVICE", None)
os.environ.pop("TORCHNEURON_REMOTE_CACHE", None)

import pytest  # noqa: E402
import torch  # noqa: E402

import torchneuron  # noqa: E402


def pytest_sessionfinish(session, exitstatus):
    if "_SESSION_CACHE" in globals():
        import shutil

        shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


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
