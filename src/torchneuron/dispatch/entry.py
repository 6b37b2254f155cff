"""The one dispatch entry point: every aten op on a neuron tensor that is not
pure metadata (allocation, views: csrc/kernels.cpp) arrives here.

This is where execution strategies plug in. Today every op runs on the host
fallback; the compile-first path (one op -> one cached IREE executable) is
chosen here when it exists, and the fallback stays for what it cannot take.
"""

from __future__ import annotations

import functools
import warnings

import torch

from .. import _C, config
from . import host_fallback, stats
from .op_info import op_info

_NEURON = "neuron"
_warned: set = set()


class FallbackError(RuntimeError):
    """Raised when an op would run on the host fallback and the policy is 'error'."""


def _device_of(args, kwargs, info):
    """The op's neuron device, after checking, as CUDA does, that no tensor
    argument is on another device (0-dim CPU tensors pass as scalars)."""
    tensors = list(_named_tensors(args, kwargs, info))
    device = next((t.device for _, t in tensors if t.device.type == _NEURON), None)
    if device is None:  # a factory op: the device is an argument
        for value in list(kwargs.values()) + list(args):
            if isinstance(value, torch.device) and value.type == _NEURON:
                index = value.index if value.index is not None else _C.current_device()
                return torch.device(_NEURON, index)
        return torch.device(_NEURON, _C.current_device())
    if info.checks_devices:
        for name, t in tensors:
            if t.device != device and (t.device.type == _NEURON or t.dim() > 0):
                raise RuntimeError(
                    "Expected all tensors to be on the same device, but got "
                    f"{name} is on {t.device}, different from other tensors on {device} "
                    f"(when checking argument in method {info.name})"
                )
    return device


def _named_tensors(args, kwargs, info):
    names = info.arg_names
    for i, value in enumerate(args):
        name = names[i] if i < len(names) else f"arg{i}"
        if isinstance(value, torch.Tensor):
            yield name, value
        elif isinstance(value, (list, tuple)):
            for v in value:
                if isinstance(v, torch.Tensor):
                    yield name, v
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            yield name, value


def dispatch(op, *args, **kwargs):
    info = op_info(op)
    stats.record(stats.dispatched, info.name)
    device = _device_of(args, kwargs, info)
    return _run_on_host(op, info, args, kwargs, device)


def _run_on_host(op, info, args, kwargs, device):
    policy = config.settings.fallback
    if policy == "error":
        raise FallbackError(
            f"{info.name} would run on the host fallback, and TORCHNEURON_FALLBACK=error "
            "forbids it (set TORCHNEURON_FALLBACK=allow or warn to permit it)."
        )
    if policy == "warn" and info.name not in _warned:
        _warned.add(info.name)
        warnings.warn(f"torchneuron: {info.name} runs on the host fallback", stacklevel=3)
    stats.record(stats.host_fallback, info.name)
    return host_fallback.run(op, info, args, kwargs, device)


_libraries: list = []


def _ops_taken_whole() -> list:
    """Ops that PyTorch would otherwise break up before they reach neuron.

    A backend without its own kernel for an op gets PyTorch's generic
    decomposition: structured ops run as an empty result plus their out=
    variant, ops with a generic CompositeExplicitAutograd kernel (layer_norm,
    ...) run as several smaller ops, _foreach_ ops run one tensor at a time.
    Taking them here sees the op the user called, which is what a compiled
    executable wants, and gives CPU's exact numerics on the host fallback.
    Views stay with PyTorch's composite kernels (metadata only, via as_strided).
    """
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    ops = []
    for name in torch._C._dispatch_get_all_op_names():
        if not name.startswith("aten::") or has_kernel(name, "PrivateUse1"):
            continue
        if has_kernel(name, "CompositeExplicitAutogradNonFunctional"):
            ops.append(name)
        elif has_kernel(name, "CompositeExplicitAutograd") and (
            name.startswith("aten::_foreach_") or (has_kernel(name, "CPU") and not _returns_view(name))
        ):
            ops.append(name)
    return ops


def _returns_view(qualified: str) -> bool:
    name, _, overload = qualified[len("aten::"):].partition(".")
    schema = getattr(getattr(torch.ops.aten, name), overload or "default")._schema
    return any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def install() -> None:
    """Make `dispatch` the PrivateUse1 kernel of every op that has no C++ one."""
    if _libraries:
        return
    fallback = torch.library.Library("_", "IMPL")
    fallback.fallback(dispatch, dispatch_key="PrivateUse1")
    aten = torch.library.Library("aten", "IMPL")
    for qualified in _ops_taken_whole():
        name, _, overload = qualified[len("aten::"):].partition(".")
        op = getattr(getattr(torch.ops.aten, name), overload or "default")
        aten.impl(qualified[len("aten::"):], functools.partial(dispatch, op), "PrivateUse1")
    _libraries.extend([fallback, aten])
