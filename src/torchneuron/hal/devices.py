"""The IREE HAL devices behind the neuron devices: one per device index, on
the configured driver, created on first use."""

from __future__ import annotations

import functools
import os
import threading

from .. import config

_lock = threading.Lock()
_devices: dict = {}


@functools.lru_cache(maxsize=None)
def available_drivers() -> tuple:
    import iree.runtime as ireert

    return tuple(sorted(ireert.query_available_drivers()))


# How each driver's devices hold memory. "unified": device memory is host
# memory, which IREE imports with no copy (its CPU drivers); "discrete": the
# device has memory of its own, reached only through transfers (a GPU, an
# accelerator's HBM; memory/device_memory.py, runtime/transfers.py).
MEMORY_MODELS = {"local-task": "unified", "local-sync": "unified"}
UNIFIED_DRIVERS = tuple(d for d, model in MEMORY_MODELS.items() if model == "unified")


def memory_model(driver: str) -> str:
    return MEMORY_MODELS.get(driver, "discrete")


def memory_model_in_use() -> str:
    """The memory model of the neuron devices: the driver's own, or the one
    TORCHNEURON_MEMORY forces (discrete on a CPU driver tests that path)."""
    forced = config.settings.memory
    return memory_model(config.settings.driver) if forced == "auto" else forced


def memory_problem() -> str | None:
    """Why the configured memory model cannot be used, or None."""
    driver = config.settings.driver
    if config.settings.memory == "unified" and memory_model(driver) != "unified":
        return (
            f"neuron: TORCHNEURON_MEMORY=unified needs a driver whose devices use host memory "
            f"({', '.join(UNIFIED_DRIVERS)}); {driver!r} gives its devices memory of their own"
        )
    return None


def driver_problem(driver: str) -> str | None:
    """Why `driver` cannot back the neuron devices, or None if it can."""
    drivers = available_drivers()
    if driver not in drivers:
        return (
            f"neuron: the target driver {driver!r} (TORCHNEURON_DRIVER) is not available; "
            f"available drivers: {', '.join(drivers)}"
        )
    if memory_model(driver) != "unified":
        found = _devices_of(driver)
        if isinstance(found, str) or not found:
            why = found if isinstance(found, str) else "it found no device"
            return (
                f"neuron: the target driver {driver!r} (TORCHNEURON_DRIVER) cannot be used: {why}. "
                f"Drivers with devices here: {', '.join(d for d in drivers if _has_devices(d))}"
            )
    return None


def device_names(driver: str) -> tuple:
    """The names of a driver's devices; () for the CPU drivers (the host) or
    a driver without devices."""
    if driver in UNIFIED_DRIVERS:
        return ()
    found = _devices_of(driver)
    return found if isinstance(found, tuple) else ()


def _has_devices(driver: str) -> bool:
    if driver in UNIFIED_DRIVERS:
        return True  # the CPU
    found = _devices_of(driver)
    return isinstance(found, tuple) and bool(found)


@functools.lru_cache(maxsize=None)
def _devices_of(driver: str):
    """The names of a driver's devices, or why it has none (a string)."""
    import iree.runtime as ireert

    try:
        return tuple(d.get("name", "?") for d in ireert.get_driver(driver).query_available_devices())
    except Exception as e:  # noqa: BLE001 - no hardware or no system driver behind it: say so
        return str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__


def describe_drivers() -> dict:
    """{driver: {"memory": model, "devices": [names] or "error": why}} for
    every driver this IREE runtime carries (`torchneuron info`)."""
    found = {}
    for driver in available_drivers():
        entry = {"memory": memory_model(driver)}
        devices = _devices_of(driver)
        if isinstance(devices, str):
            entry["error"] = devices
        else:
            entry["devices"] = list(devices)
        found[driver] = entry
    return found


def hal_device(index: int):
    """The HAL device of neuron:index, created on first use."""
    with _lock:
        device = _devices.get(index)
        if device is None:
            driver = config.settings.driver
            problem = driver_problem(driver)
            if problem:
                raise RuntimeError(problem)
            import iree.runtime as ireert

            _set_workers(ireert, driver)
            try:
                device = _create(ireert, driver, index)
            except Exception as e:  # noqa: BLE001 - IREE raises plain RuntimeError/ValueError
                raise RuntimeError(f"neuron: cannot create a device on driver {driver!r}: {e}") from e
            _devices[index] = device
        return device


def _create(ireert, driver: str, index: int):
    """neuron:index's HAL device. On the CPU drivers each index gets a device
    of its own (the host has room for as many as asked). On a driver with
    physical devices, neuron:i is physical device i, the way cuda:i is; indices
    beyond the devices present (TORCHNEURON_DEVICE_COUNT above the count, to
    run multi-device programs on one GPU) share them in turn, one HAL device
    per physical device: several logical devices on one physical device
    (lavapipe, found in the test suite) lost the device under load."""
    iree_driver = ireert.get_driver(driver)
    if driver in UNIFIED_DRIVERS:
        return iree_driver.create_default_device()
    infos = iree_driver.query_available_devices()
    physical = index % len(infos)
    for other, device in _devices.items():
        if other % len(infos) == physical:
            return device
    before = _thread_ids()
    device = iree_driver.create_device(infos[physical])
    if "llvmpipe" in infos[physical].get("name", ""):
        _let_waiters_yield(_thread_ids() - before)
    return device


def _thread_ids() -> set:
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:  # not Linux: nothing to find
        return set()


def _let_waiters_yield(new_threads: set) -> None:
    """Lavapipe (Mesa's software Vulkan, CI's device) answers IREE's
    wait-for-any-semaphore by polling the clock: the two threads IREE starts
    per device to wait for completions spin a core each, idle or not, and
    starved the compile workers beside them (an adaptive graph's compile
    waited a minute). Run them at idle priority: they still take any core
    nobody else wants. Lavapipe's own workers (llvmpipe-N) keep theirs."""
    for tid in new_threads:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            if name.startswith("llvmpipe"):
                continue
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except (OSError, AttributeError):  # the thread ended, or no SCHED_IDLE here
            pass


_workers_set = False


def _set_workers(ireert, driver: str) -> None:
    """IREE's task pool (local-task) takes its worker count from a flag read
    once, when the driver is first made: set it before that. By default one
    worker per core; fewer leave the program's threads a core of their own
    (docs/configuration.md: a dispatch-bound training step gains, a
    compute-bound one loses)."""
    global _workers_set
    workers = config.settings.device_workers
    if driver == "local-task" and workers > 0 and not _workers_set:
        ireert.flags.parse_flags(f"--task_topology_group_count={workers}")
        _workers_set = True


# Small launches run inline on the calling thread (IREE's local-sync driver)
# when the devices are the CPU's task pool: handing a tiny op to a worker
# thread costs more than running it (docs/architecture.md).
INLINE_DRIVERS = {"local-task": "local-sync"}
_inline: dict = {}


def inline_device(index: int):
    """The HAL device small launches of neuron:index run on, or None when the
    driver has no inline counterpart."""
    inline_driver = INLINE_DRIVERS.get(config.settings.driver)
    if inline_driver is None or inline_driver not in available_drivers():
        return None
    with _lock:
        device = _inline.get(index)
        if device is None:
            import iree.runtime as ireert

            device = _inline[index] = ireert.get_driver(inline_driver).create_default_device()
        return device


def created_devices() -> dict:
    with _lock:
        return dict(_devices)


def release_devices() -> None:
    with _lock:
        _devices.clear()
        _inline.clear()
