import os

# Two neuron devices, so cross-device behaviour is tested; set before torch loads.
os.environ.setdefault("TORCHNEURON_DEVICE_COUNT", "2")
# A fresh persistent cache per run, so counts of compiles are the same on
# every run (TORCHNEURON_TEST_CACHE_DIR reuses one across runs, for speed).
# Under pytest-xdist (`make test` runs two workers) the workers inherit the
# controller's directory, so what one worker compiled the other reuses, as
# processes sharing a cache do.
if "TORCHNEURON_TEST_CACHE_DIR" in os.environ:
    os.environ["TORCHNEURON_CACHE_DIR"] = os.environ["TORCHNEURON_TEST_CACHE_DIR"]
elif "PYTEST_XDIST_WORKER" in os.environ and "_TORCHNEURON_RUN_CACHE" in os.environ:
    os.environ["TORCHNEURON_CACHE_DIR"] = os.environ["_TORCHNEURON_RUN_CACHE"]
else:
    import tempfile

    os.environ["TORCHNEURON_CACHE_DIR"] = tempfile.mkdtemp(prefix="torchneuron-test-cache-")
    os.environ["_TORCHNEURON_RUN_CACHE"] = _SESSION_CACHE = os.environ["TORCHNEURON_CACHE_DIR"]
os.environ.pop("TORCHNEURON_COMPILE_SERVICE", None)
# The op-mode suite tests compiled executables: each op waits for its build
# instead of running on the host meanwhile, here and in the processes tests
# start (tests of that tier, and of adaptive eager, turn it back off).
if os.environ.get("TORCHNEURON_EAGER_MODE", "op") == "op":
    os.environ.setdefault("TORCHNEURON_COMPILE_WAIT", "1")
os.environ.pop("TORCHNEURON_REMOTE_CACHE", None)

import pytest  # noqa: E402
import torch  # noqa: E402

import torchneuron  # noqa: E402


def pytest_sessionfinish(session, exitstatus):
    if "_SESSION_CACHE" in globals():
        import shutil

        shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "op_mode: tests of op-by-op eager's own mechanisms; they run in op mode in every suite run"
    )
    config.addinivalue_line(
        "markers", "compile_wait: tests of what one call does once compiled (or declined by the compiler); "
        "they wait for compiles in either eager mode"
    )
    config.addinivalue_line(
        "markers", "thorough: slow tests of what other tests in CI's run also cover; `make test` (CI) leaves "
        "them out, `make test-full` runs them"
    )
    config.addinivalue_line(
        "markers", "unified_memory: tests of the unified model's zero-copy host aliases of device memory; "
        "not run when the suite runs under the discrete model (TORCHNEURON_MEMORY=discrete), which has none"
    )


@pytest.fixture(autouse=True)
def _fresh_settings(request):
    """Each test starts with the default fallback policy and no memory limit,
    in the suite's eager mode (TORCHNEURON_EAGER_MODE), or op mode for tests
    marked op_mode; in op mode, compiles are waited for."""
    if request.node.get_closest_marker("unified_memory") is not None and torchneuron._C.discrete_memory():
        pytest.skip("zero-copy host aliases exist on the unified memory model only")
    saved = torchneuron.config.as_dict()
    saved_env = {k: os.environ.get(k) for k in ("TORCHNEURON_EAGER_MODE", "TORCHNEURON_COMPILE_WAIT")}
    if request.node.get_closest_marker("op_mode") is not None:
        torchneuron.set_eager_mode("op")
        # and so do the processes the test starts, as in the op-mode suite
        os.environ["TORCHNEURON_EAGER_MODE"] = "op"
        os.environ.setdefault("TORCHNEURON_COMPILE_WAIT", "1")
    if torchneuron.get_eager_mode() == "op" or request.node.get_closest_marker("compile_wait") is not None:
        torchneuron.config.set(compile_wait=True)  # as above
    yield
    torch.neuron.synchronize()
    torchneuron.config.set(
        fallback=saved["fallback"],
        memory_limit_mb=saved["memory_limit_mb"],
        execution=saved["execution"],
        launch_blocking=saved["launch_blocking"],
        eager_mode=saved["eager_mode"],
        compile_wait=saved["compile_wait"],
        adaptive_max_ops=saved["adaptive_max_ops"],
        adaptive_held_kb=saved["adaptive_held_kb"],
        adaptive_peak_cuts=saved["adaptive_peak_cuts"],
        inline_elements=saved["inline_elements"],
    )
    torch.neuron.set_device(0)
    for key, value in saved_env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


# -- the real servers (see servers.py) ---------------------------------------------

@pytest.fixture
def service():
    """A real compile service on a unix socket, with its own cache directory."""
    import shutil
    import tempfile

    import servers

    base = tempfile.mkdtemp(prefix="tn-svc-")  # short: unix socket paths are limited
    address = os.path.join(base, "s.sock")
    proc = servers.start_compile_service(address, os.path.join(base, "cache"))
    yield address, proc
    servers.stop(proc)
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def client_settings(tmp_path):
    """This process as a fresh client: empty plan table, its own disk cache;
    the shared layers' settings are restored afterwards."""
    from torchneuron.dispatch import eager

    names = ("cache_dir", "compile_service", "remote_cache", "cache_secret", "cache_secret_file")
    saved = {name: torchneuron.config.get(name) for name in names}  # get(): as_dict hides secrets
    eager.reset()
    torchneuron.config.set(cache_dir=str(tmp_path / "client-cache"))
    yield
    eager.reset()
    torchneuron.config.set(**saved)


@pytest.fixture
def redis_server(tmp_path):
    """A real Redis server on loopback: (url, process, redis client)."""
    import subprocess

    import redis
    import servers

    port = servers.free_port()
    proc = subprocess.Popen([servers.redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    servers.wait_for(lambda: servers.pings(client), 30, "redis-server")
    yield f"redis://127.0.0.1:{port}/0", proc, client
    proc.kill()
    proc.wait()


@pytest.fixture
def compiled_only():
    """Every op of the test compiles: none reaches the host path."""
    torchneuron.reset_stats()
    yield
    assert torchneuron.fallback_ops() == {}, torchneuron.compile_stats()["not_compiled"]


def assert_same(neuron_value, cpu_value, **tol):
    """A neuron result equals the CPU result (values, dtype, shape)."""
    assert isinstance(neuron_value, torch.Tensor)
    assert neuron_value.device.type == "neuron", neuron_value.device
    torch.testing.assert_close(neuron_value.cpu(), cpu_value, **tol)


# The slowest files first, slowest first (worker-seconds of a cold run, 2026-12-07: distributed
# 1115, vllm 720, kernel_library 715, autocast 514, float8 482, training_libraries ~330,
# memory_ownership 389, targets 331): with --dist loadfile and --no-loadscope-reorder (the
# Makefile's; xdist otherwise orders files by their number of tests, which put test_vllm.py
# last, alone on one worker for minutes) each starts while the other worker takes the rest.
_FIRST = ("test_distributed.py", "test_vllm.py", "test_kernel_library.py", "test_autocast.py", "test_float8.py",
          "test_memory_ownership.py", "test_training_libraries.py", "test_targets.py", "test_function_accuracy.py",
          "test_adaptive.py", "test_eval_registry.py", "test_census.py", "test_complex.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(_FIRST)))  # stable: the rest keep their order
