"""The IREE HAL devices behind the neuron devices: one per device index, on
the configured driver, created on first use."""

from __future__ import annotations

import functools
import threading

from .. import config

_lock = threading.Lock()
_devices: dict = {}


@functools.lru_cache(maxsize=None)
def available_drivers() -> tuple:
    import iree.runtime as ireert

    return tuple(sorted(ireert.query_available_drivers()))


def driver_problem(driver: str) -> str | None:
    """Why `driver` cannot back the neuron devices, or None if it can."""
    drivers = available_drivers()
    if driver not in drivers:
        return (
            f"neuron: the target driver {driver!r} (TORCHNEURON_DRIVER) is not available; "
            f"available drivers: {', '.join(drivers)}"
        )
    return None


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
                device = ireert.get_driver(driver).create_default_device()
            except Exception as e:  # noqa: BLE001 - IREE raises plain RuntimeError/ValueError
                raise RuntimeError(f"neuron: cannot create a device on driver {driver!r}: {e}") from e
            _devices[index] = device
        return device


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
