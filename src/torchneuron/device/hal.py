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

            try:
                device = ireert.get_driver(driver).create_default_device()
            except Exception as e:  # noqa: BLE001 - IREE raises plain RuntimeError/ValueError
                raise RuntimeError(f"neuron: cannot create a device on driver {driver!r}: {e}") from e
            _devices[index] = device
        return device


def created_devices() -> dict:
    with _lock:
        return dict(_devices)


def release_devices() -> None:
    with _lock:
        _devices.clear()
