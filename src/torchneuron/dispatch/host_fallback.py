"""Host fallback: run an op with PyTorch's CPU kernels on host views of the
device memory.

On the unified memory model (IREE's CPU drivers) device memory is host
memory, so a neuron tensor's CPU alias (`_C.host_alias`) has the same
storage, sizes, strides and offset, and in-place and `out=` ops write straight
into device memory. On the discrete model the bytes the arguments cover are
copied to the host once per storage (runtime/transfers.py), and what the op
writes is copied back. Either way new results are copied into fresh device
storage, and results that alias an input become neuron views of that input.
"""

from __future__ import annotations

import threading
import warnings

import torch

from .. import _C, config
from ..runtime import generators as neuron_random
from ..runtime import transfers
from ..lowering.call import numbers_as_tensors
from . import host_threads, stats

_NEURON = "neuron"
_rng_lock = threading.Lock()



class FallbackError(RuntimeError):
    """Raised when an op would run on the host fallback and the policy is 'error'."""


_warned: set = set()


def admit(name: str, reason: str, stacklevel: int = 4) -> None:
    """The fallback policy, for an op the compiler declined (in op mode, or
    one by one inside an adaptive graph): raise, warn once, or allow; the op
    is counted in fallback_ops()."""
    policy = config.settings.fallback
    if policy == "error":
        raise FallbackError(
            f"{name} would run on the host fallback ({reason}), and TORCHNEURON_FALLBACK=error "
            "forbids it (set TORCHNEURON_FALLBACK=allow or warn to permit it)."
        )
    if policy == "warn" and name not in _warned:
        _warned.add(name)
        warnings.warn(f"torchneuron: {name} runs on the host fallback: {reason}", stacklevel=stacklevel)
    stats.record(stats.host_fallback, name)


def _neuron_tensors(value, found: list) -> list:
    if isinstance(value, torch.Tensor):
        if value.device.type == _NEURON:
            found.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _neuron_tensors(v, found)
    return found


def _host_tensors(args, kwargs) -> list:
    found = []
    for value in (*args, *(kwargs or {}).values()):
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.numel() > 0:
                found.append(t)
    return found


def to_host_all(args, kwargs: dict, aliases: dict, written_only=()) -> tuple:
    """(host args, host kwargs): neuron tensors (also inside lists) -> host
    views, neuron devices -> cpu. `aliases` maps id(host view) to (host view,
    neuron tensor, storage byte its host storage starts at). `written_only`:
    names of out= keyword arguments, which the op writes whole without reading
    (on the discrete model they are not copied to the host)."""
    staged = None
    if transfers.discrete():
        found = _neuron_tensors(args, [])
        blank = []
        for name, value in (kwargs or {}).items():
            _neuron_tensors(value, blank if name in written_only else found)
        staged = transfers.stage(found, blank)
    host_args = to_host(args, aliases, staged)
    host_kwargs = {k: to_host(v, aliases, staged) for k, v in kwargs.items()} if kwargs else {}
    return host_args, host_kwargs


def to_host(value, aliases: dict, staged: dict | None = None):
    """Neuron tensors (also inside lists) -> host views; neuron devices -> cpu.
    `staged`: the host copies of the discrete model (transfers.stage)."""
    if isinstance(value, torch.Tensor):
        if value.device.type == _NEURON:
            if staged is None:
                alias, start = _C.host_alias(value), 0
            else:
                alias, start = staged[id(value)]
            aliases[id(alias)] = (alias, value, start)
            return alias
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(to_host(v, aliases, staged) for v in value)
    if isinstance(value, torch.device) and value.type == _NEURON:
        return torch.device("cpu")
    return value


def _view_of_input(host: torch.Tensor, bases: list):
    """A neuron view for a result that shares memory with a neuron input."""
    if host.numel() == 0:
        return None
    ptr = host.untyped_storage().data_ptr()
    for alias, neuron, start in bases:
        if alias.untyped_storage().data_ptr() == ptr and alias.dtype == host.dtype:
            return torch.ops.aten.as_strided.default(
                neuron, host.shape, host.stride(), host.storage_offset() + start // host.element_size()
            )
    return None


def _to_device(value, aliases: dict, bases: list, device: torch.device, kept: frozenset = frozenset()):
    """The op's results on the device: its neuron arguments where it returned
    them, views of them, or new device copies. `kept`: the storages of its
    host arguments, which stay where they are when returned."""
    if isinstance(value, torch.Tensor):
        original = aliases.get(id(value))
        if original is not None and original[0] is value:
            return original[1]  # in-place / out=: the op returned its argument
        if value.device.type != "cpu" or value.untyped_storage().data_ptr() in kept:
            return value  # a host argument the op wrote (copy_ into a CPU tensor): it stays there
        view = _view_of_input(value, bases)
        return view if view is not None else transfers.device_copy_of(value, device.index)
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, aliases, bases, device, kept) for v in value)
    return value


def _write_back(neuron: torch.Tensor, alias: torch.Tensor, storage: int, start: int) -> None:
    """A written argument: its bytes back to the device (discrete model), and
    the new shape an out= argument the CPU kernel resized was given.
    `storage`: the host storage's address before the op ran."""
    if alias.untyped_storage().data_ptr() != storage:
        # The kernel needed more memory than the argument had: the host view
        # got a new host buffer. Move its contents into new device storage.
        fresh = transfers.device_copy_of(alias, neuron.device.index)
        torch.ops.aten.set_.source_Tensor(neuron, fresh)
        return
    offset = alias.storage_offset() + start // alias.element_size()
    if alias.shape != neuron.shape or alias.stride() != neuron.stride() or offset != neuron.storage_offset():
        torch.ops.aten.set_.source_Storage_storage_offset(
            neuron, neuron.untyped_storage(), offset, alias.shape, alias.stride()
        )
    if transfers.discrete():
        transfers.write_back(neuron, alias, start)


def _copy_from(src_host: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False):
    transfers.write_into(dst, src_host)
    return dst


# Backward ops whose saved statistics (mean, rstd) PyTorch's CPU kernel wants
# in the input's type when input and weight are float16/bfloat16, while the
# meta kernels (which give compiled results their types) make them float32:
# (position of the input, positions of the statistics, position of the weight).
_STATISTICS = {
    "aten.native_layer_norm_backward.default": (1, (3, 4), 5),
    "aten.native_batch_norm_backward.default": (1, (5, 6), 2),
}


def as_cpu_expects(name: str, host_args):
    """Host arguments as the CPU kernel accepts them: float32 statistics that
    a compiled forward saved for a low precision input are given the input's
    type (what the CPU forward would have saved)."""
    found = _STATISTICS.get(name)
    if found is None:
        return host_args
    x_at, stats_at, weight_at = found
    x, weight = host_args[x_at], host_args[weight_at]
    if x.dtype not in (torch.float16, torch.bfloat16) or (weight is not None and weight.dtype != x.dtype):
        return host_args
    fixed = list(host_args)
    for i in stats_at:
        if fixed[i] is not None and fixed[i].dtype != x.dtype:
            fixed[i] = fixed[i].to(x.dtype)
    return tuple(fixed)


def run(op, info, args, kwargs, device: torch.device):
    """Run `op` on the host. `device` is where new results are placed."""
    host_threads.confine()
    aliases: dict = {}
    name = info.name
    if name == "aten._copy_from.default" or name == "aten._copy_from_and_resize.default":
        src, dst = args[0], args[1]
        src_host = transfers.to_host(src) if src.device.type == _NEURON else src
        if name == "aten._copy_from_and_resize.default" and dst.shape != src.shape:
            dst.resize_(src.shape)
        if dst.device.type == _NEURON:
            return _copy_from(src_host, dst)
        dst.copy_(src_host)
        return dst
    if name == "aten.copy_.default" and not kwargs and len(args) == 2 and _between_host_and_device(*args):
        # dst.copy_(src) across host and device: one transfer, the destination not read first.
        dst, src = args
        if dst.device.type == _NEURON:
            transfers.write_into(dst, src)
        else:
            dst.copy_(transfers.to_host(src))
        return dst

    host_args, host_kwargs = to_host_all(args, kwargs, aliases, info.out_args)
    host_args, host_kwargs = numbers_as_tensors(op, host_args, host_kwargs)
    bases = list(aliases.values())
    storages = {key: entry[0].untyped_storage().data_ptr() for key, entry in aliases.items()}
    kept = frozenset(t.untyped_storage().data_ptr() for t in _host_tensors(args, kwargs))

    if info.seeded:
        result = run_seeded(op, host_args, host_kwargs, device)
    else:
        result = op(*as_cpu_expects(name, host_args), **host_kwargs)

    sync_mutated(info, args, kwargs, host_args, host_kwargs, aliases, storages)
    return _to_device(result, aliases, bases, device, kept)


def _between_host_and_device(dst, src) -> bool:
    return {dst.device.type, src.device.type} == {_NEURON, "cpu"}


def sync_mutated(info, args, kwargs, host_args, host_kwargs, aliases: dict, storages: dict) -> None:
    """After a host op: what it wrote into its arguments reaches the device
    (`storages`: each host view's storage address before the op)."""
    for arg_name in info.mutated_args:
        if arg_name in kwargs:
            neuron, alias = kwargs[arg_name], host_kwargs[arg_name]
        else:
            index = info.arg_names.index(arg_name)
            if index >= len(args):
                continue
            neuron, alias = args[index], host_args[index]
        pairs = zip(neuron, alias) if isinstance(neuron, (list, tuple)) else ((neuron, alias),)
        for n, a in pairs:
            if isinstance(n, torch.Tensor) and n.device.type == _NEURON and id(a) in aliases:
                _write_back(n, a, storages[id(a)], aliases[id(a)][2])


def run_seeded(op, host_args, host_kwargs, device):
    """Random ops draw from the neuron generator: its state is loaded into the
    CPU default generator for the call, so seeded runs match CPU exactly."""
    host_threads.confine()
    generator = host_kwargs.get("generator")
    if generator is None:
        generator = neuron_random.default_generator(device.index)
    elif generator.device.type != _NEURON:
        raise RuntimeError(
            f"Expected a 'neuron' device type for generator but found '{generator.device.type}'"
        )
    if "generator" in host_kwargs:
        host_kwargs = dict(host_kwargs, generator=None)
    cpu = torch.default_generator
    with _rng_lock:
        saved = cpu.get_state()
        cpu.set_state(generator.get_state())
        try:
            return op(*host_args, **host_kwargs)
        finally:
            generator.set_state(cpu.get_state())
            cpu.set_state(saved)
