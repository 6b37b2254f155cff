"""Every torchneuron setting, in one place.

Each setting is read from its environment variable when torchneuron loads and
can be changed from code with `torchneuron.config.set(name=value)` (or by
assigning the attribute). Settings that the C++ glue holds (device count,
memory limit) are pushed to it when they change.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

FALLBACK_POLICIES = ("allow", "warn", "error")


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None


def _env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    raw = os.environ.get(name, default).strip().lower() or default
    if raw not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {raw!r}")
    return raw


@dataclass
class Settings:
    # Number of neuron devices; each is its own IREE HAL device.
    device_count: int = field(default_factory=lambda: _env_int("TORCHNEURON_DEVICE_COUNT", 1))
    # IREE HAL driver that backs the devices ("local-task": multithreaded CPU).
    driver: str = field(default_factory=lambda: os.environ.get("TORCHNEURON_DRIVER", "local-task"))
    # What happens when an op runs on the host fallback: allow (record only),
    # warn (record and warn once per op), error (raise).
    fallback: str = field(
        default_factory=lambda: _env_choice("TORCHNEURON_FALLBACK", "allow", FALLBACK_POLICIES)
    )
    # Per-device memory limit in MiB; 0 means no limit.
    memory_limit_mb: int = field(default_factory=lambda: _env_int("TORCHNEURON_MEMORY_LIMIT_MB", 0))


settings = Settings()
_listeners: list = []


def on_change(fn) -> None:
    """Call fn(name, value) whenever a setting changes (used to push to C++)."""
    _listeners.append(fn)


def set(**changes) -> None:  # noqa: A001 - the natural name for a settings API
    names = {f.name for f in fields(Settings)}
    for name, value in changes.items():
        if name not in names:
            raise AttributeError(f"unknown torchneuron setting {name!r}; known: {', '.join(sorted(names))}")
        if name == "fallback" and value not in FALLBACK_POLICIES:
            raise ValueError(f"fallback must be one of {', '.join(FALLBACK_POLICIES)}, got {value!r}")
        setattr(settings, name, value)
        for fn in _listeners:
            fn(name, value)


def get(name: str):
    return getattr(settings, name)


def as_dict() -> dict:
    return {f.name: getattr(settings, f.name) for f in fields(Settings)}
