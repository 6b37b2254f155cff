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
EXECUTION_MODES = ("compile", "host")
EAGER_MODES = ("op", "adaptive")


def _env_number(name: str, default, parse=int):
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return parse(raw)
    except ValueError:
        kind = "an integer" if parse is int else "a number"
        raise ValueError(f"{name} must be {kind}, got {raw!r}") from None


def _env_int(name: str, default: int) -> int:
    return _env_number(name, default)


def _env_float(name: str, default: float) -> float:
    return _env_number(name, default, float)


def _env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    raw = os.environ.get(name, default).strip().lower() or default
    if raw not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {raw!r}")
    return raw


def _default_compile_memory_mb() -> int:
    """A quarter of the machine's memory, at least 2 GiB: room for the
    largest compiles measured (a few hundred MiB), while a compiler that
    loops (IREE 3.13 did, on some one-element graphs, growing past 9 GB)
    is stopped before it takes the program's memory."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1 << 20)
    except (ValueError, OSError, AttributeError):
        return 0
    return max(2048, total // 4)


MEMORY_MODELS = ("auto", "unified", "discrete")


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "torchneuron")


@dataclass
class Settings:
    # Number of neuron devices; each is its own IREE HAL device.
    device_count: int = field(default_factory=lambda: _env_int("TORCHNEURON_DEVICE_COUNT", 1))
    # IREE HAL driver that backs the devices ("local-task": multithreaded CPU).
    driver: str = field(default_factory=lambda: os.environ.get("TORCHNEURON_DRIVER", "local-task"))
    # Where storages live: "auto" (the driver's own model), "unified" (host
    # memory IREE imports with no copy: its CPU drivers) or "discrete" (device
    # buffers reached only through transfers: a GPU's or accelerator's memory;
    # forced on the CPU driver, it tests that path at CPU speed).
    memory: str = field(default_factory=lambda: _env_choice("TORCHNEURON_MEMORY", "auto", MEMORY_MODELS))
    # What happens when an op runs on the host fallback: allow (record only),
    # warn (record and warn once per op), error (raise).
    fallback: str = field(
        default_factory=lambda: _env_choice("TORCHNEURON_FALLBACK", "allow", FALLBACK_POLICIES)
    )
    # Per-device memory limit in MiB; 0 means no limit.
    memory_limit_mb: int = field(default_factory=lambda: _env_int("TORCHNEURON_MEMORY_LIMIT_MB", 0))
    # How eager ops run: "compile" (each op a cached IREE executable, host
    # fallback where the compiler says no) or "host" (every op on the host).
    execution: str = field(
        default_factory=lambda: _env_choice("TORCHNEURON_EXECUTION", "compile", EXECUTION_MODES)
    )
    # How eager ops are grouped: "op" (each op its own launch) or "adaptive"
    # (ops recorded into graphs, each graph one fused executable, compiled in
    # the background while the ops run one by one).
    eager_mode: str = field(default_factory=lambda: _env_choice("TORCHNEURON_EAGER_MODE", "op", EAGER_MODES))
    # Adaptive eager: ops in a graph before it is cut regardless.
    adaptive_max_ops: int = field(default_factory=lambda: _env_int("TORCHNEURON_ADAPTIVE_MAX_OPS", 32))
    # Adaptive eager cuts a pending graph once the inputs only it still holds
    # (the program dropped them; op mode would have freed them) pass this many
    # KiB: less peak memory for smaller graphs (-1: never). Measured on the
    # demo step (docs/benchmarks.md): 128 brings the peak down to op mode's,
    # but 7.5 ops per graph instead of 30 make the step slower than op mode's.
    adaptive_held_kb: int = field(default_factory=lambda: _env_int("TORCHNEURON_ADAPTIVE_HELD_KB", -1))
    # Adaptive eager learns where the inputs a graph holds after the program
    # dropped them would lift memory past op mode's peak, and from the next
    # iteration cuts graphs right after their last read of them.
    adaptive_peak_cuts: bool = field(default_factory=lambda: _env_int("TORCHNEURON_ADAPTIVE_PEAK_CUTS", 1) != 0)
    # Wait for every compile instead of running what is not compiled yet on
    # the op path or the host (for debugging and comparisons).
    compile_wait: bool = field(default_factory=lambda: _env_int("TORCHNEURON_COMPILE_WAIT", 0) != 0)
    # torch.compile(backend="neuron"): a graph that fails to lower or compile
    # raises instead of running in neuron eager mode with a warning.
    compile_strict: bool = field(default_factory=lambda: _env_int("TORCHNEURON_COMPILE_STRICT", 0) != 0)
    # Make every launch synchronous, so errors surface at the op that caused them.
    launch_blocking: bool = field(default_factory=lambda: _env_int("TORCHNEURON_LAUNCH_BLOCKING", 0) != 0)
    # Guarded memory: guard bytes around every device allocation, poisoned
    # frees, checked after every launch (slow; for finding ops that write
    # outside their memory). Set before the first allocation.
    check_memory: bool = field(default_factory=lambda: _env_int("TORCHNEURON_CHECK_MEMORY", 0) != 0)
    # Launches whose largest tensor has at most this many elements run inline
    # on the calling thread (local-task driver only; 0: never); an adaptive
    # fused graph, when all its tensors' elements together are at most this.
    inline_elements: int = field(default_factory=lambda: _env_int("TORCHNEURON_INLINE_ELEMENTS", 65536))
    # Worker threads of IREE's task pool (local-task driver; 0: one per core).
    # Read when the first device is made.
    device_workers: int = field(default_factory=lambda: _env_int("TORCHNEURON_DEVICE_WORKERS", 0))
    # Launches queued on a device before the host waits for the oldest.
    max_in_flight: int = field(default_factory=lambda: _env_int("TORCHNEURON_MAX_IN_FLIGHT", 64))
    # At the first neuron op, move the objects alive then (imported modules,
    # the model) out of the garbage collector's scans (gc.freeze): a full
    # collection over torch's import-time heap otherwise stalls a cold
    # first step by 130-180 ms (see dispatch/entry.py).
    gc_freeze: bool = field(default_factory=lambda: _env_int("TORCHNEURON_GC_FREEZE", 1) != 0)
    # Load the profiler's Python side at import (torch.profiler then records
    # the device's events); 0: not loaded until `import torchneuron.profiler`.
    profiler: bool = field(default_factory=lambda: _env_int("TORCHNEURON_PROFILER", 1) != 0)
    # Compile workers (0: one per core).
    compile_workers: int = field(default_factory=lambda: _env_int("TORCHNEURON_COMPILE_WORKERS", 0))
    # Limits of each compiler process: seconds before it is stopped, and MiB
    # of data memory (0: no limit). A compile stopped by either fails as any
    # compile failure does (the op runs on the host, a graph in eager mode),
    # with an error naming the limit.
    compile_timeout_s: float = field(default_factory=lambda: _env_float("TORCHNEURON_COMPILE_TIMEOUT", 1200.0))
    compile_memory_mb: int = field(
        default_factory=lambda: _env_int("TORCHNEURON_COMPILE_MEMORY_MB", _default_compile_memory_mb())
    )
    # In-memory executable cache bounds.
    cache_max_entries: int = field(default_factory=lambda: _env_int("TORCHNEURON_CACHE_MAX_ENTRIES", 4096))
    cache_max_mb: int = field(default_factory=lambda: _env_int("TORCHNEURON_CACHE_MAX_MB", 1024))
    # Persistent executable cache shared by the processes of this user on this
    # host ("" or "off": none).
    cache_dir: str = field(default_factory=lambda: os.environ.get("TORCHNEURON_CACHE_DIR", _default_cache_dir()))
    # Size cap of the persistent cache: least recently used entries go first.
    cache_size_mb: int = field(default_factory=lambda: _env_int("TORCHNEURON_CACHE_SIZE_MB", 4096))
    # Accept a cache directory that other users can write to (it holds code
    # this process runs, so it is refused by default).
    cache_allow_shared: bool = field(default_factory=lambda: _env_int("TORCHNEURON_CACHE_ALLOW_SHARED", 0) != 0)
    # Seconds to wait for another process compiling the same key before
    # compiling it here anyway.
    cache_lock_timeout: float = field(default_factory=lambda: float(_env_int("TORCHNEURON_CACHE_LOCK_TIMEOUT", 300)))
    # The shared compile service: a unix socket path or host:port ("": none).
    compile_service: str = field(default_factory=lambda: os.environ.get("TORCHNEURON_COMPILE_SERVICE", ""))
    # A remote executable store shared across hosts: redis://host:port/db ("": none).
    remote_cache: str = field(default_factory=lambda: os.environ.get("TORCHNEURON_REMOTE_CACHE", ""))
    # The secret shared by every host and service that may hand this process
    # executables: remote entries, service replies and leader entries carry an
    # HMAC made with it and are refused without one ("": none). Either the
    # secret itself or a key file (mode 0600) holding it; never both.
    cache_secret: str = field(default_factory=lambda: os.environ.get("TORCHNEURON_CACHE_SECRET", ""), repr=False)
    cache_secret_file: str = field(default_factory=lambda: os.environ.get("TORCHNEURON_CACHE_SECRET_FILE", ""))
    # Inside a torch.distributed job: one rank compiles each key and publishes
    # it through the job's store, the others fetch it.
    leader_compile: bool = field(default_factory=lambda: _env_int("TORCHNEURON_LEADER_COMPILE", 1) != 0)
    # Seconds a rank waits for the leader's executable before compiling itself.
    leader_timeout: float = field(default_factory=lambda: float(_env_int("TORCHNEURON_LEADER_TIMEOUT", 300)))
    # The CPU executables are compiled for: "host" (this machine's CPU, as the
    # compiler detects it) or an LLVM CPU name ("haswell", "skylake-avx512")
    # with its default features. Resolved to an explicit name and feature
    # list, which the cache key records; a CPU with features this host lacks
    # is refused (its code could not run here).
    target_cpu: str = field(default_factory=lambda: os.environ.get("TORCHNEURON_TARGET_CPU", "host").strip() or "host")
    # Progress line for bursts of compiles: auto (on a terminal), on, off.
    progress: str = field(default_factory=lambda: _env_choice("TORCHNEURON_PROGRESS", "auto", ("auto", "on", "off")))


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
        if name == "memory" and value not in MEMORY_MODELS:
            raise ValueError(f"memory must be one of {', '.join(MEMORY_MODELS)}, got {value!r}")
        if name == "fallback" and value not in FALLBACK_POLICIES:
            raise ValueError(f"fallback must be one of {', '.join(FALLBACK_POLICIES)}, got {value!r}")
        if name == "eager_mode" and value not in EAGER_MODES:
            raise ValueError(f"eager_mode must be one of {', '.join(EAGER_MODES)}, got {value!r}")
        if name == "adaptive_max_ops" and (not isinstance(value, int) or value < 1):
            raise ValueError(f"adaptive_max_ops must be a positive integer, got {value!r}")
        if name == "adaptive_held_kb" and (not isinstance(value, int) or value < -1):
            raise ValueError(f"adaptive_held_kb must be an integer >= -1 (-1: never), got {value!r}")
        if name == "execution" and value not in EXECUTION_MODES:
            raise ValueError(f"execution must be one of {', '.join(EXECUTION_MODES)}, got {value!r}")
        setattr(settings, name, value)
        for fn in _listeners:
            fn(name, value)


def get(name: str):
    return getattr(settings, name)


# Settings whose value is a secret: dumps say only whether they are set.
SECRET_SETTINGS = ("cache_secret",)


def as_dict() -> dict:
    """Every setting, for display and for saving and restoring; secrets show
    as "set" or "not set" (read them with get())."""
    values = {f.name: getattr(settings, f.name) for f in fields(Settings)}
    for name in SECRET_SETTINGS:
        values[name] = "set" if values[name] else "not set"
    return values
