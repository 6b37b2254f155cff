"""Collectives on neuron tensors: PyTorch's c10d ops, run by gloo on the
tensors' host aliases.

Every collective a process group runs (dist.all_reduce, DDP's buckets,
FSDP2's all-gathers, the functional collectives DTensor uses) is a c10d op
dispatched on its tensors' device. The neuron kernel of each:

1. waits for the device work that the collective's tensors depend on (every
   stream of the device is drained: a stream that only waits on another's
   event has nothing of its own to wait for, and FSDP2 issues its collectives
   on such streams; adaptive eager's pending graph is cut first), so gloo
   reads finished values;
2. calls the same op on zero-copy CPU aliases of the tensors (on the CPU
   target device memory is host memory), which gloo runs; outputs land in
   the neuron tensors' memory with no copy;
3. returns the neuron tensors and gloo's Work: `wait()` returns once gloo
   has written them, and device work issued after it reads the results.

On the discrete memory model (a device with memory of its own) the host has
no alias of a neuron tensor: gloo gets host copies (the inputs' values, empty
buffers for pure outputs), and once it has finished, what it wrote is copied
back into the neuron tensors before the kernel returns; the Work it returns
has completed. Each copy is a counted transfer (`transfer_stats()`).

gloo has no PREMUL_SUM(f) (FSDP2 with a gradient divide factor): the inputs
are scaled by f on the device and summed (the factor is read by csrc/distributed.cpp).

The process group's CPU backend carries the aliases; a group created for
neuron only gets the neuron backend (a gloo) registered for CPU too.
"""

from __future__ import annotations

import threading
import warnings

import torch

from .. import _C

# Every c10d collective; each op's neuron kernel is the one below.
OPS = (
    "allreduce_", "allreduce_coalesced_", "broadcast_", "reduce_", "allgather_", "_allgather_base_",
    "allgather_coalesced_", "allgather_into_tensor_coalesced_", "reduce_scatter_", "_reduce_scatter_base_",
    "reduce_scatter_tensor_coalesced_", "alltoall_", "alltoall_base_", "gather_", "scatter_", "barrier",
    "monitored_barrier_", "send", "recv_", "recv_any_source_",
)

# The hot collectives (DDP's buckets, FSDP2's flat all-gathers and
# reduce-scatters) have the same kernels in C++ (csrc/distributed.cpp): a
# Python kernel's boxed arguments cost ~40 us per call, a third of a 1 MB
# all_reduce on 2 ranks.
_IN_CPP = ("allreduce_", "_allgather_base_", "_reduce_scatter_base_")

_library = None
_lock = threading.Lock()
_NEURON = "neuron"
_CPU = torch.device("cpu")


def _aliases(value, found: dict, devices: set):
    """Neuron tensors (also in nested lists) -> their CPU aliases."""
    if isinstance(value, torch.Tensor):
        if value.device.type != _NEURON:
            return value
        devices.add(value.device.index)
        alias = _C.host_alias(value)
        found[id(alias)] = (alias, value)
        return alias
    if isinstance(value, (list, tuple)):
        return type(value)(_aliases(v, found, devices) for v in value)
    return value


# What each collective writes: the arguments copied back after gloo on the
# discrete model; those listed in _READ_AND_WRITTEN are read first too.
_WRITTEN = {
    "allreduce_": "tensors", "allreduce_coalesced_": "tensors", "broadcast_": "tensors", "reduce_": "tensors",
    "allgather_": "output_tensors", "_allgather_base_": "output_tensor", "allgather_coalesced_": "output_lists",
    "allgather_into_tensor_coalesced_": "outputs", "reduce_scatter_": "output_tensors",
    "_reduce_scatter_base_": "output_tensor", "reduce_scatter_tensor_coalesced_": "outputs",
    "alltoall_": "output_tensors", "alltoall_base_": "output", "gather_": "output_tensors",
    "scatter_": "output_tensors", "recv_": "tensors", "recv_any_source_": "tensors",
}
_READ_AND_WRITTEN = ("allreduce_", "allreduce_coalesced_", "broadcast_", "reduce_")


def _host_copies(value, found: dict, with_values: bool):
    """Neuron tensors (also in nested lists) -> host tensors gloo can use: the
    tensors' values, or (pure outputs) empty buffers of their layout."""
    if isinstance(value, torch.Tensor):
        if value.device.type != _NEURON:
            return value
        host = value.cpu() if with_values else torch.empty_like(value, device=_CPU)
        found[id(host)] = (host, value)
        return host
    if isinstance(value, (list, tuple)):
        return type(value)(_host_copies(v, found, with_values) for v in value)
    return value


def _copy_back(value, found: dict) -> None:
    if isinstance(value, torch.Tensor):
        entry = found.get(id(value))
        if entry is not None and entry[0] is value:
            entry[1].copy_(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _copy_back(v, found)


def _works(result):
    """The Work(s) a c10d op returned, as pybind objects."""
    if isinstance(result, (list, tuple)):
        return [w for value in result for w in _works(value)]
    if isinstance(result, torch.ScriptObject):
        return [torch._C._distributed_c10d.Work.unbox(result)]
    return []


class _ReceivedWork(torch._C._distributed_c10d.Work):
    """A receive on the discrete model: wait() waits for gloo, then copies
    what arrived into the neuron tensors. (A point-to-point Work of gloo's
    counts completions: waiting on it twice waits for a second message, so
    the kernel cannot wait for it and hand it on, and a receive that waited
    inside its kernel would deadlock a program that receives before it sends.)"""

    # Until waited on, each is kept here: c10d holds only its C++ half, and
    # without the Python object its wait() would be c10d's own, which never ends.
    _pending: set = set()

    def __init__(self, inner, copies, found):
        super().__init__()
        self._inner, self._copies, self._found = inner, copies, found
        _ReceivedWork._pending.add(self)

    def wait(self, timeout=None):
        if self._found is not None:
            done = self._inner.wait() if timeout is None else self._inner.wait(timeout)
            _copy_back(self._copies, self._found)
            self._found = None
            _ReceivedWork._pending.discard(self)
            return done
        return True

    def is_completed(self):
        if self._found is not None and self._inner.is_completed():
            self.wait()  # (what arrived is in the neuron tensors once this says so)
        return self._found is None

    def source_rank(self):
        return self._inner.source_rank()


def _staged(op, name, names, args, kwargs):
    """A collective on the discrete model: gloo on host copies, then what it
    wrote copied back (see the module's docstring)."""
    found: dict = {}
    written = _WRITTEN.get(name)
    bound = dict(zip(names, args))
    bound.update(kwargs)
    host = {key: _host_copies(value, found, key != written or name in _READ_AND_WRITTEN)
            for key, value in bound.items()}
    _with_cpu_backend(bound["process_group"])
    result = op(*(host[n] for n in names[: len(args)]), **{k: host[k] for k in kwargs})
    if name == "send":  # gloo's Work holds the host copy until it is sent
        return result
    if name in ("recv_", "recv_any_source_"):
        (work,) = _works(result)
        return _ReceivedWork(work, host[written], found).boxed()
    for work in _works(result):
        work.wait()  # (a collective's Work of gloo's may be waited on again)
    if written is not None:
        _copy_back(host[written], found)
    return _originals(result, found)


def _originals(value, found: dict):
    """The op's results, with each alias replaced by its neuron tensor."""
    if isinstance(value, torch.Tensor):
        entry = found.get(id(value))
        return entry[1] if entry is not None and entry[0] is value else value
    if isinstance(value, (list, tuple)):
        return type(value)(_originals(v, found) for v in value)
    return value


def _with_cpu_backend(process_group) -> None:
    """Make the group's CPU backend carry the aliases: a group made for neuron
    tensors only (init_process_group() on a neuron host) lends it its neuron
    backend, which is gloo. It is registered as GLOO: such a group's default
    backend type is GLOO (torch picks it for a group with no backend named),
    which DDP and get_backend look up."""
    group = torch._C._distributed_c10d.ProcessGroup.unbox(process_group)
    if _CPU in group._device_types:
        return
    with _lock:
        if _CPU not in group._device_types:
            group._register_backend(_CPU, torch._C._distributed_c10d.ProcessGroup.BackendType.GLOO,
                                    group._get_backend(torch.device(_NEURON)))


_PREMUL_SUM = 8  # c10d::ReduceOp::RedOpType
# Where a reduction's inputs are: updated in place (the op's own tensors), or
# inputs to leave as they are (a scaled copy is reduced instead).
# (all_reduce and _reduce_scatter_base do this in csrc/distributed.cpp.)
_REDUCED_IN_PLACE = {"allreduce_coalesced_": "tensors", "reduce_": "tensors"}
_REDUCED_INPUTS = {"reduce_scatter_": "input_tensors",
                   "reduce_scatter_tensor_coalesced_": "inputs"}


def _scaled(value, factor, in_place):
    if isinstance(value, torch.Tensor):
        return value.mul_(factor) if in_place else value * factor
    return type(value)(_scaled(v, factor, in_place) for v in value)


def _premul_sum_as_sum(name, names, args):
    """gloo has no PREMUL_SUM(f): scale the inputs by f on the device, then sum."""
    args = list(args)
    at = names.index("reduce_op")
    factor, args[at] = _C.premul_sum(args[at])
    where = names.index(_REDUCED_IN_PLACE.get(name) or _REDUCED_INPUTS[name])
    args[where] = _scaled(args[where], factor, name in _REDUCED_IN_PLACE)
    return tuple(args)


def _kernel(op):
    names = [a.name for a in op._schema.arguments]
    group_at = names.index("process_group")
    name = op._schema.name.split("::", 1)[1]
    reduce_at = names.index("reduce_op") if "reduce_op" in names else None

    def collective(*args, **kwargs):
        # (PyTorch passes the c10d ops' arguments by position.)
        if reduce_at is not None and reduce_at < len(args) and args[reduce_at].op() == _PREMUL_SUM:
            args = _premul_sum_as_sum(name, names, args)
        if _C.discrete_memory():
            return _staged(op, name, names, args, kwargs)
        found: dict = {}
        devices: set = set()
        host_args = _aliases(args, found, devices)
        host_kwargs = {k: _aliases(v, found, devices) for k, v in kwargs.items()} if kwargs else kwargs
        for index in devices:
            torch.neuron.synchronize(index)  # gloo reads what the device has finished writing
        _with_cpu_backend(args[group_at] if group_at < len(args) else kwargs["process_group"])
        return _originals(op(*host_args, **host_kwargs), found)

    collective.__name__ = str(op)
    return collective


def install() -> None:
    global _library
    if _library is not None:
        return
    library = torch.library.Library("c10d", "IMPL")
    with warnings.catch_warnings():
        # PyTorch registers a neuron (PrivateUse1) kernel for each that asks the
        # group's neuron backend; these replace it.
        warnings.simplefilter("ignore")
        for name in OPS:
            packet = getattr(torch.ops.c10d, name, None)
            if packet is not None and name not in _IN_CPP:
                library.impl(name, _kernel(packet.default), "PrivateUse1")
    _C.register_collective_kernels()
    _library = library
