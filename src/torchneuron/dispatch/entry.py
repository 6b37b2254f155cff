"""The one dispatch entry point: every aten op on a neuron tensor that is not
pure metadata (allocation, views: csrc/kernels.cpp) arrives here.

Every execution mode starts here. In op mode a call runs as its cached
executable (cached_launch.py for calls seen before, eager.py for the rest);
in adaptive eager the recorder (adaptive/, installed as `recording`) takes
it into the pending graph; a call whose executable is still compiling, or
that no executable can take, runs on the host path (host_fallback.py), and
`TORCHNEURON_FALLBACK=error` makes the latter an error. Copies between
devices and metadata-only ops go on to PyTorch's composite kernels.
"""

from __future__ import annotations

import atexit
import functools
import gc
import threading
import time

import torch

from .. import _C, config, runtime, trace
from ..runtime import transfers
from ..lowering import NotCompilable, WritesSharedMemory
from . import cached_launch, eager, fused_optimizers, host_fallback, math_bits, shape_recording, stats, warm_start
from .op_info import METADATA_OPS, op_info

_NEURON = "neuron"
FallbackError = host_fallback.FallbackError


def _first_op(device) -> None:
    """Once per process, at the first neuron op."""
    warm_start.begin(device.index if device.index is not None else 0)
    if config.settings.gc_freeze:
        # A neuron program's first steps allocate enough (signatures, plans,
        # modules the lowering imports) to set off a full collection, which
        # scans every object torch's import left: 130-180 ms on a cold first
        # step (0.03-0.05 s with the rest), where CPU eager's allocations
        # set off none. Objects alive now are kept out of later scans; they
        # are freed by reference counting as before (only garbage cycles
        # among them would outlive the program's use of them).
        gc.freeze()
        atexit.register(gc.unfreeze)  # teardown collects them as usual


def _device_of(args, kwargs, info):
    """The op's neuron device, after checking, as CUDA does, that no tensor
    argument is on another device (0-dim CPU tensors pass as scalars)."""
    if not kwargs:
        # The common case, cheaply: positional tensors all on one neuron device.
        device = None
        for value in args:
            if isinstance(value, torch.Tensor):
                d = value.device
                if device is None:
                    device = d
                elif d != device:
                    break
            elif isinstance(value, (list, tuple)):
                break
        else:
            if device is not None and device.type == _NEURON:
                return device
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


# Ops that read or move data between host and device: never compiled, not "fallback".
_TRANSFERS = frozenset(
    {"aten._local_scalar_dense.default", "aten._copy_from.default", "aten._copy_from_and_resize.default"}
)


# Set in a child forked from a process that used the device: its IREE
# runtime and compile threads did not survive the fork.
unusable_reason = ""

# Adaptive eager's recorder (torchneuron.adaptive.recorder) while that mode is
# on: calls are recorded into graphs instead of launched one by one.
recording = None


class _Quiet(threading.local):
    on = False


_quiet = _Quiet()
_record_functions = torch._C._autograd._enable_record_function


def _dispatch_quietly(op, args, kwargs):
    """While a profiler records: the op's own CPU event is recorded (the
    dispatcher began it), the aten ops this backend runs to carry it out
    (empty, set_, as_strided, ...) are not; they would be most of the trace
    and of its cost. Its launches still link to the op."""
    _quiet.on = True
    _record_functions(False)
    try:
        return dispatch(op, *args, **kwargs)
    finally:
        _record_functions(True)
        _quiet.on = False


def dispatch(op, *args, **kwargs):
    if trace.sink is not None and not _quiet.on:
        return _dispatch_quietly(op, args, kwargs)
    if op in math_bits.OPS:
        result = math_bits.resolve(op, args, kwargs)
        if result is not math_bits.UNCHANGED:
            return result
    compiled = config.settings.execution == "compile"
    recorder = shape_recording._recorder  # recording shapes sees every call: no shortcut then
    if compiled and recorder is None and not unusable_reason:
        result = recording.record(op, args, kwargs) if recording is not None else cached_launch.run(op, args, kwargs)
        if result is not cached_launch.MISS:
            return result
    if unusable_reason:
        raise RuntimeError(unusable_reason)
    info = op_info(op)
    stats.record(stats.dispatched, info.name)
    device = _device_of(args, kwargs, info)
    if not warm_start._started:
        _first_op(device)
    if recorder is not None:
        recorder.record(info.name, args, kwargs)
    if info.metadata_only:
        return op.redispatch(_COMPOSITE_SLOT, *args, **kwargs)
    if info.name in _TRANSFERS or (info.name in _COPIES and _crosses_devices(args, kwargs, device)):
        return _transfer(op, info, args, kwargs, device)
    parity = _CUDA_PARITY.get(info.name)
    if parity is not None:
        result = parity(*args, **kwargs)
        if result is not NotImplemented:
            return result
    if compiled:
        return _run_compiled(op, info, args, kwargs, device, recorder is None)
    return _run_on_host(op, info, args, kwargs, device, "execution=host")


def _run_compiled(op, info, args, kwargs, device, record: bool):
    """Compile mode: the adaptive recorder (where `record`: no shape
    recording is on) or the op's executable; the host path for what neither
    takes, and for random ops (CPU's generator stream)."""
    if info.seeded:
        if record and recording is not None:
            result = recording.record_random(op, info, args, kwargs, device)
            if result is not cached_launch.MISS:
                return result
        return _run_on_host(op, info, args, kwargs, device, "random ops use the CPU-compatible generator")
    rewrite = _REWRITES.get(info.name)
    if rewrite is not None:
        result = rewrite(*args, **kwargs)
        if result is not NotImplemented:
            return result
    if record and recording is not None:
        result = recording.record_slow(op, info, args, kwargs, device)
        if result is recording.FIRST_MEETING:
            return run_while_compiling(op, info, args, kwargs, device)
        if result is not cached_launch.MISS:
            return result
    try:
        try:
            return eager.run(op, info, args, kwargs, device, remember=True)
        except WritesSharedMemory:
            # Once more with the inputs it reads copied; a write that still
            # shares memory takes the host path below.
            args, kwargs = _copy_what_the_op_reads_of_its_writes(info, args, kwargs)
            return eager.run(op, info, args, kwargs, device)
    except eager.Compiling:
        return run_while_compiling(op, info, args, kwargs, device)
    except NotCompilable as e:
        reason = str(e)
        stats.fallback_reasons.setdefault(info.name, reason)
        if info.composite_only:
            # No CPU kernel: PyTorch's generic kernel (in the CPU slot)
            # breaks the op into smaller neuron ops instead.
            stats.record(stats.decomposed, info.name)
            return op.redispatch(_COMPOSITE_SLOT, *args, **kwargs)
    return _run_on_host(op, info, args, kwargs, device, reason)


def _copy_what_the_op_reads_of_its_writes(info, args, kwargs):
    """(args, kwargs) with each tensor the op only reads copied when it shares
    memory with one the op writes: the op then reads the values from before
    the call, as PyTorch's kernels do (cumsum.out(x, out=x) reads all of x
    before it writes)."""
    written = _written_tensors(info, args, kwargs)

    def unshared(v, name):
        if isinstance(v, torch.Tensor) and name not in info.mutated_args and _copy_first(v, written):
            return v.clone()
        if isinstance(v, (list, tuple)) and name not in info.mutated_args:
            return type(v)(unshared(x, name) for x in v)
        return v

    names = info.arg_names
    args = tuple(unshared(v, names[i] if i < len(names) else None) for i, v in enumerate(args))
    return args, {k: unshared(v, k) for k, v in kwargs.items()}


def _copy_first(read, written) -> bool:
    """Whether `read` shares memory with a written tensor and is either the
    same elements or none of theirs. A partial overlap keeps PyTorch's own
    verdict (its kernels refuse most), from the host path."""
    shares = [w for w in written if w.untyped_storage().data_ptr() == read.untyped_storage().data_ptr()]
    for w in shares:
        same = (w.data_ptr(), w.shape, w.stride()) == (read.data_ptr(), read.shape, read.stride())
        if not same and _byte_ranges_meet(w, read):
            return False
    return bool(shares)


def _byte_ranges_meet(a, b) -> bool:
    def span(t):
        last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 0) if t.numel() else -1
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def _written_tensors(info, args, kwargs):
    names = info.arg_names
    found = [v for i, v in enumerate(args) if i < len(names) and names[i] in info.mutated_args]
    found += [v for k, v in kwargs.items() if k in info.mutated_args]
    flat = []
    for v in found:
        flat.extend(v if isinstance(v, (list, tuple)) else [v])
    return [t for t in flat if isinstance(t, torch.Tensor)]


def _equal(a, b):
    """torch.equal as device ops plus one host read (it returns a Python bool)."""
    if a.device != b.device or a.dtype != b.dtype:
        return NotImplemented
    if a.shape != b.shape:
        return False
    return bool(torch.ops.aten.eq.Tensor(a, b).all().item())


def _convolution_backward_overrideable(grad, input, weight, stride, padding, dilation, transposed,
                                       output_padding, groups, output_mask):
    """What PyTorch's generic convolution_backward calls on a backend without
    its own kernel (after the compiler declined the convolution_backward):
    CPU has no kernel for it, so the host runs convolution_backward itself."""
    op = torch.ops.aten.convolution_backward.default
    bias_sizes = None
    if output_mask[2]:
        bias_sizes = [weight.shape[1] * groups if transposed else weight.shape[0]]
    args = (grad, input, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups,
            output_mask)
    return _run_on_host(op, op_info(op), args, {}, grad.device, "a convolution backward the compiler declined")


def _convolution_overrideable(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    """What PyTorch's generic convolution calls on a backend without its own
    kernel, after the compiler declined the convolution: the host runs it."""
    op = torch.ops.aten.convolution.default
    args = (input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
    return _run_on_host(op, op_info(op), args, {}, input.device, "a convolution the compiler declined")


_COUNTABLE = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _bincount(x, weights=None, minlength=0):
    """bincount as CUDA computes it: the result's length (the largest value
    + 1, at least minlength) read from the device, then a compiled
    index_add of ones or of the weights. CPU's result dtype and its errors;
    other inputs (float, bool) take the host path and CPU's error."""
    if x.dtype not in _COUNTABLE or (weights is not None and (weights.dtype.is_complex or weights.dtype == torch.bool)):
        return NotImplemented
    if minlength < 0:
        raise RuntimeError("minlength should be >= 0")
    if x.dim() != 1:
        raise RuntimeError("bincount only supports 1-d non-negative integral inputs.")
    if weights is not None and (weights.dim() != 1 or weights.shape[0] != x.shape[0]):
        raise RuntimeError("weights should be 1-d and have the same length as input")
    if not x.numel():
        return torch.zeros(minlength, dtype=torch.int64, device=x.device)  # CPU's, whatever the weights
    x = x.long()
    smallest, largest = torch.stack([x.min(), x.max()]).tolist()  # one read, as CUDA's kernel reads
    if smallest < 0:
        raise RuntimeError("bincount only supports 1-d non-negative integral inputs.")
    length = max(minlength, largest + 1)
    if weights is None:
        counted, dtype = torch.ones_like(x, dtype=torch.int64), torch.int64
    else:
        dtype = torch.float32 if weights.dtype == torch.float32 else torch.float64
        counted = weights.to(dtype)
    return torch.zeros(length, dtype=dtype, device=x.device).index_add_(0, x, counted)


# Ops that are better expressed through other device ops than compiled whole.
_REWRITES = {
    "aten.bincount.default": _bincount,
    "aten.convolution_overrideable.default": _convolution_overrideable,
    "aten.equal.default": _equal,
    "aten.convolution_backward_overrideable.default": _convolution_backward_overrideable,
    **fused_optimizers.REWRITES,  # Adam(fused=True), AdamW(fused=True): the device's foreach ops
}


def _histc_of_integers(x, bins=100, min=0, max=0):  # noqa: A002 - the op's argument names
    """histc of an integer tensor, as CUDA allows (CPU does not): libraries
    count MoE routing with it on accelerators (transformers' moe.py)."""
    if x.dtype.is_floating_point or x.dtype.is_complex:
        return NotImplemented
    return torch.histc(x.to(torch.float32), bins, min, max).to(x.dtype)


# Inputs CUDA accepts and PyTorch's CPU kernels do not: code written for
# accelerators relies on them.
def _record_stream(tensor, stream):
    """Tensor.record_stream: nothing to record. Every launch holds the blocks
    it uses until it is done, on whichever stream (runtime/queue.py), so a
    block is never handed out again while another stream still uses it."""
    return None


_CUDA_PARITY = {"aten.histc.default": _histc_of_integers, "aten.record_stream.default": _record_stream}


_NON_BLOCKING_COPIES = frozenset({"aten._copy_from.default", "aten.copy_.default"})


def _transfer(op, info, args, kwargs, device):
    if info.name == "aten._to_copy.default":
        # To another device: PyTorch's kernel allocates there and copies (back here).
        return op.redispatch(_COMPOSITE_SLOT, *args, **kwargs)
    if info.name == "aten._copy_from.default":
        src, dst = args[0], args[1]
        if (
            config.settings.execution == "compile"
            and src.device == dst.device
            and src.dtype == dst.dtype
        ):
            # A copy within one device (clone, contiguous, cat of views...) is device work.
            if recording is not None and shape_recording._recorder is None:
                result = recording.record_slow(_COPY, op_info(_COPY), (dst, src), {}, device)
                if result is recording.FIRST_MEETING:
                    run_while_compiling(_COPY, op_info(_COPY), (dst, src), {}, device)
                    return dst
                if result is not cached_launch.MISS:
                    return dst
            try:
                eager.run(_COPY, op_info(_COPY), (dst, src), {}, device)
                return dst
            except (NotCompilable, eager.Compiling):
                pass
    if info.name in _NON_BLOCKING_COPIES:
        # Pinned host memory: the copy is queued on the stream, not waited for.
        src, dst = (args[0], args[1]) if info.name == "aten._copy_from.default" else (args[1], args[0])
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        if transfers.queued_copy(src, dst, non_blocking):
            stats.record(stats.transfers, info.name)
            return dst
    runtime.synchronize_all()
    stats.record(stats.transfers, info.name)
    watching = trace.sink
    if watching is None:
        return host_fallback.run(op, info, args, kwargs, device)
    started = time.time_ns()
    result = host_fallback.run(op, info, args, kwargs, device)
    moved = max((a.nbytes for a in args if isinstance(a, torch.Tensor)), default=0)  # copy_(dst, src): once
    watching.host("transfer", info.name, started, time.time_ns(), bytes=moved)
    return result


_COPY = torch.ops.aten.copy_.default
# Copies that may name the host as source, destination or target device.
_COPIES = frozenset({"aten.copy_.default", "aten._to_copy.default", "aten.copy.default"})


def _crosses_devices(args, kwargs, device) -> bool:
    """A copy from or to another device (host or another neuron device)."""
    for value in args:
        if isinstance(value, torch.Tensor) and value.device != device:
            return True
    target = kwargs.get("device")
    if target is None:
        return False
    target = torch.device(target)
    return target.type != _NEURON or (target.index is not None and target.index != device.index)
_COMPOSITE_SLOT = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


def run_while_compiling(op, info, args, kwargs, device):
    """An op whose executable is being built: run it now without it. Not a
    fallback (no policy applies: it will be compiled)."""
    stats.record(stats.host_while_compiling, info.name)
    # Ops with only a generic kernel run it on the host too: broken into
    # device ops, each piece would be a signature of its own to build.
    if not info.host_kernel:
        return _by_decomposition(op, info, args, kwargs, "its executable is still compiling")
    return _on_host(op, info, args, kwargs, device, "its executable is still compiling")


def _by_decomposition(op, info, args, kwargs, reason):
    decomposition = _decomposition_of(op)
    if decomposition is None:
        raise NotImplementedError(f"neuron: {info.name} has no kernel on the host and {reason}")
    stats.record(stats.decomposed, info.name)
    return decomposition(*args, **kwargs)


def _on_host(op, info, args, kwargs, device, why):
    runtime.synchronize_all()
    watching = trace.sink
    started = time.time_ns() if watching is not None else 0
    result = host_fallback.run(op, info, args, kwargs, device)
    if watching is not None:
        watching.host("host op", info.name, started, time.time_ns(), reason=why)
    if config.settings.check_memory:
        from ..runtime import memory_guards
        from ..runtime.errors import user_source_line

        memory_guards.verify(f"{info.name} (on the host fallback)", user_source_line())
    return result


def _run_on_host(op, info, args, kwargs, device, reason):
    if not info.host_kernel:
        # Ops PyTorch sends accelerators only (the fused RNN cells): CPU has no
        # kernel, so they run as their decomposition into smaller neuron ops.
        return _by_decomposition(op, info, args, kwargs, f"the compiler declined it ({reason})")
    host_fallback.admit(info.name, reason)
    return _on_host(op, info, args, kwargs, device, f"host fallback: {reason}")


def _decomposition_of(op):
    from torch._decomp import decomposition_table

    from ..lowering.decompositions import own_decompositions

    return own_decompositions().get(op) or decomposition_table.get(op)


_libraries: list = []


def _ops_taken_whole() -> list:
    """Ops that PyTorch would otherwise break up before they reach neuron.

    A backend without its own kernel for an op gets PyTorch's generic
    decomposition: structured ops run as an empty result plus their out=
    variant, ops with a generic CompositeExplicitAutograd kernel (layer_norm,
    factories, clone) run as several smaller ops, _foreach_ ops run one tensor
    at a time. Taking them here sees the op the user called, which is what a
    compiled executable wants, and gives CPU's exact numerics on the host
    fallback. Views keep PyTorch's composite kernels (metadata only, via
    as_strided), and so do allocations (empty*) and random ops (whose
    composites end in an in-place random op that reaches us anyway).
    """
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    ops = []
    for name in torch._C._dispatch_get_all_op_names():
        if not name.startswith("aten::") or has_kernel(name, "PrivateUse1"):
            continue
        if has_kernel(name, "CompositeExplicitAutogradNonFunctional"):
            if "empty" not in name:
                ops.append(name)
        elif has_kernel(name, "CompositeExplicitAutograd"):
            op = _overload(name)
            if (
                "empty" not in name
                and name.split(".")[0] not in METADATA_OPS
                and not _returns_view(op)
                and torch.Tag.nondeterministic_seeded not in op.tags
                and (
                    any(str(r.type) in ("Tensor", "List[Tensor]") for r in op._schema.returns)
                    or any(a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments)
                )
            ):
                ops.append(name)
    return ops




def _overload(qualified: str):
    name, _, overload = qualified[len("aten::"):].partition(".")
    return getattr(getattr(torch.ops.aten, name), overload or "default")


def _returns_view(op) -> bool:
    return any(r.alias_info is not None and not r.alias_info.is_write for r in op._schema.returns)


# The C++ entry (csrc/recording.cpp) is the PrivateUse1 kernel of these ops;
# it passes every call it does not record itself on to `dispatch`, here.
_PYTHON_ENTRY = "PrivateUse2"


def install() -> None:
    """Make `dispatch` the kernel behind the C++ entry for every op that has no C++ kernel."""
    if _libraries:
        return
    taken = _ops_taken_whole()
    fallback = torch.library.Library("_", "IMPL")
    fallback.fallback(dispatch, dispatch_key=_PYTHON_ENTRY)
    aten = torch.library.Library("aten", "IMPL")
    for qualified in taken:
        aten.impl(qualified[len("aten::"):], functools.partial(dispatch, _overload(qualified)), _PYTHON_ENTRY)
    _C.route_ops([qualified[len("aten::"):] for qualified in taken])
    _libraries.extend([fallback, aten])
