"""torchneuron: a native PyTorch device, "neuron", for a compile-first accelerator.

`import torch` loads this package through the `torch.backends` entry point, so
user code only names the device: `x.to("neuron")`. The functions of
`torch.neuron` are also available here.
"""

from __future__ import annotations

from .version import __version__  # noqa: F401


def _autoload() -> None:
    """Entry point run by `import torch`; importing this package registers the device.

    Defined before `import torch` so that importing torchneuron first (which
    imports torch, which autoloads torchneuron) finds it."""


import torch  # noqa: E402,F401

from . import config  # noqa: E402
from .device.module import (  # noqa: E402,F401
    current_device,
    current_stream,
    default_generators,
    default_stream,
    device,
    device_count,
    empty_cache,
    get_amp_supported_dtype,
    get_rng_state,
    get_rng_state_all,
    init,
    initial_seed,
    is_available,
    is_initialized,
    manual_seed,
    manual_seed_all,
    max_memory_allocated,
    memory_allocated,
    memory_limit,
    memory_stats,
    reset_peak_memory_stats,
    seed,
    seed_all,
    set_device,
    set_memory_limit,
    set_rng_state,
    set_rng_state_all,
    stream,
    synchronize,
)
from .dispatch.entry import FallbackError  # noqa: E402
from .memory.dtypes import SUPPORTED_DTYPES  # noqa: E402
from .registration import register as _register  # noqa: E402
from .dispatch import stats as _stats  # noqa: E402
from .dynamo import stats as _dynamo_stats  # noqa: E402

_register()

from .adaptive import eager_mode, get_eager_mode, set_eager_mode, wait_for_compiles  # noqa: E402,F401
from .dynamo import GraphCompileError  # noqa: E402,F401


def supported_dtypes() -> tuple:
    """The dtypes a neuron tensor can have on the current target."""
    return SUPPORTED_DTYPES


def fallback_ops() -> dict:
    """Ops that ran on the host fallback: {"aten.op.overload": count}."""
    return dict(_stats.host_fallback)


def op_counts() -> dict:
    """Every op dispatched to neuron: {"aten.op.overload": count}."""
    return dict(_stats.dispatched)


def execution_stats() -> dict:
    """Totals: ops dispatched, ops on the host fallback, distinct ops."""
    return _stats.snapshot()


def transfer_stats() -> dict:
    """Bytes and copies between host and device memory, and within a device,
    since start or reset_transfer_stats(): host_to_device, device_to_host,
    device_to_device and their *_copies, and the memory_model in use. Only
    the discrete model transfers: on the unified one (IREE's CPU drivers)
    device memory is host memory, and every count stays 0."""
    from .runtime.transfers import transfer_stats as stats

    return stats()


def reset_transfer_stats() -> None:
    from .runtime.transfers import reset_transfer_stats as reset

    reset()


def compile_stats() -> dict:
    """The compile path: the in-memory executable cache (hits, misses, compiles
    here, compile seconds, bytes), where executables came from (`sources`:
    compiled here, disk, remote, service, peer rank), the disk and remote
    layers, entries refused from each shared layer for lack of a valid
    signature (`remote_untrusted`, `service_untrusted`, `peer_untrusted`),
    signatures planned, calls launched by their cheap key (`cached_launches`,
    of `launch_keys` remembered), and why ops could not be compiled."""
    from .cache import executable_cache, layers, trust
    from .cache.disk import disk_cache
    from .cache.remote import remote_store
    from .dispatch import cached_launch, eager

    disk, remote = disk_cache(), remote_store()
    with layers.stats.lock:
        sources = dict(layers.stats.counts)
    return {
        **executable_cache().stats(),
        "sources": sources,
        **(disk.stats() if disk is not None else {}),
        **(remote.stats() if remote is not None else {}),
        "service_untrusted": trust.refused["service"],
        "peer_untrusted": trust.refused["peer"],
        "signatures": eager.plan_count(),
        "launch_keys": cached_launch.count(),
        "cached_launches": cached_launch.hits,
        "not_compiled": dict(_stats.fallback_reasons),
        "dynamo": _dynamo_stats.snapshot(),
    }


def adaptive_stats() -> dict:
    """Adaptive eager mode: ops recorded, graphs cut and why, ops per graph,
    launches by tier (fused, op by op), ops run inside fused executables or
    one by one (per-op executable or host), fused graphs built or failed,
    background build seconds hidden and seconds waited, and result bytes
    never written because nobody could read them."""
    from .adaptive import executor, stats

    return {**stats.snapshot(), "fused_graphs_known": executor.graph_count()}


def reset_stats() -> None:
    from .adaptive import stats

    _stats.reset()
    stats.reset()
    _dynamo_stats.reset()
