"""The signature of an op call: what identifies its executable, and the runtime
values it is launched with.

Tensors become executable inputs. Scalars whose schema type is a number
(Scalar, float and lists of them: learning rates, alphas, eps) become runtime
inputs too, packed into one float64 and one int64 tensor, so a training loop
whose scalars change every step reuses one executable. Everything else (dims,
sizes, flags, dtypes) is a constant and part of the key.

A tensor is passed directly when it is contiguous and 64-byte aligned (what
IREE imports without a copy); otherwise the aligned span of storage around it
is passed and the graph views it with as_strided, which is still no copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..compiler import NotCompilable  # noqa: F401 - raised by every lowering


class WritesSharedMemory(NotCompilable):
    """An argument the op writes shares memory with another argument
    (`torch.cumsum(x, 0, out=x)`): an executable's results never alias its
    operands."""

ALIGNMENT = 64


# Leaves of an argument structure. The tag keeps them apart in keys (named
# tuples compare as plain tuples).
class TRef(NamedTuple):  # the i-th tensor input
    i: int
    tag: str = "tensor"


class FRef(NamedTuple):  # the j-th float scalar input
    j: int
    tag: str = "float"


class IRef(NamedTuple):  # the j-th int scalar input
    j: int
    tag: str = "int"


class Seq(NamedTuple):  # a list or tuple argument
    kind: str
    items: tuple
    tag: str = "seq"


class TensorSpec(NamedTuple):
    """How one tensor argument is passed: directly, or as a span of its storage."""

    dtype: torch.dtype
    shape: tuple
    stride: tuple | None  # None: passed directly (contiguous, aligned)
    prefix: int  # elements between the span's aligned start and the tensor
    span: int  # elements in the span (0 when direct)
    on_host: bool  # a CPU tensor (0-dim scalars mixed into a neuron op)


@dataclass
class CallSignature:
    key: tuple
    args: tuple  # argument structure with TRef/FRef/IRef leaves
    kwargs: tuple  # ((name, structure), ...)
    tensors: list  # runtime tensors, by TRef index
    specs: tuple  # TensorSpec per tensor
    floats: list
    ints: list
    mutated: frozenset  # TRef indices the op writes


def _param_arg_names(op) -> frozenset:
    """Arguments whose Python numbers are runtime inputs: numbers (Scalar,
    float, lists of them) and Tensor arguments, which receive Python numbers
    as wrapped scalars (x.mul_(0.5) arrives as mul_.Tensor(x, 0.5))."""
    names = set()
    for a in op._schema.arguments:
        t = str(a.type)
        if "number" in t or "float" in t or t in ("Tensor", "Optional[Tensor]"):
            names.add(a.name)
    return frozenset(names)


def graph_param_arg_names(op) -> frozenset:
    """Runtime inputs of an op inside a fused graph: Scalar arguments (and
    lists of them) and numbers in Tensor slots. `float` arguments (eps,
    momentum, dropout scales) stay constants: op schemas that say `float`
    refuse a traced value, and they rarely change between iterations."""
    names = _graph_names_cache.get(op)
    if names is None:
        names = _graph_names_cache[op] = frozenset(
            a.name for a in op._schema.arguments
            if "number" in str(a.type) or str(a.type) in ("Tensor", "Optional[Tensor]")
        )
    return names


_graph_names_cache: dict = {}
_param_names_cache: dict = {}
# Ops whose scalars must be constants: their decompositions need the values,
# or (pow) the lowering of a runtime exponent is not exact, or (constant_pad_nd)
# IREE 3.13 cannot convert a runtime pad value to an integer tensor's type
# ("failed to legalize 'arith.fptosi' (f64) -> i64": Hugging Face pads every
# causal LM's labels with -100). Pad values rarely change.
baked_ops: set = {"aten.pow.Tensor_Scalar", "aten.pow_.Scalar", "aten.pow.Scalar", "aten.float_power.Tensor_Scalar",
                  "aten.constant_pad_nd.default"}


def tensor_spec(t: torch.Tensor) -> TensorSpec:
    on_host = t.device.type != "neuron"
    if t.is_contiguous() and t.data_ptr() % ALIGNMENT == 0:
        return TensorSpec(t.dtype, tuple(t.shape), None, 0, 0, on_host)
    if on_host:
        raise NotCompilable("a host tensor argument that is not contiguous and aligned")
    if any(s < 0 for s in t.stride()):
        raise NotCompilable("negative strides")
    itemsize = t.element_size()
    offset = t.storage_offset()
    start = (offset * itemsize // ALIGNMENT) * ALIGNMENT // itemsize
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) if t.numel() else 0
    prefix = offset - start
    return TensorSpec(t.dtype, tuple(t.shape), tuple(t.stride()), prefix, prefix + extent, on_host)


def param_arg_names(op) -> frozenset:
    params = _param_names_cache.get(op)
    if params is None:
        params = _param_names_cache[op] = _param_arg_names(op)
    return params


def signature_of(op, info, args, kwargs, params=None) -> CallSignature:
    """`params`: the arguments whose numbers are runtime inputs (default: as
    for one op's executable, see param_arg_names and baked_ops)."""
    bake = False
    if params is None:
        params = _param_names_cache.get(op)
        if params is None:
            params = param_arg_names(op)
        bake = info.name in baked_ops
    tensors: list = []
    floats: list = []
    ints: list = []
    arg_names = info.arg_names

    def leaf(v, param):
        if isinstance(v, torch.Tensor):
            tensors.append(v)
            return TRef(len(tensors) - 1)
        t = type(v)
        if t is float:
            if param and not bake:
                floats.append(v)
                return FRef(len(floats) - 1)
            return ("float", v)  # 1 and 1.0 key apart
        if t is int:
            if param and not bake:
                ints.append(v)
                return IRef(len(ints) - 1)
            return v
        if t is complex:
            return ("complex", v)  # a constant: executables take no complex scalars
        if t is list or t is tuple:
            return Seq(t.__name__, tuple(leaf(x, param) for x in v))
        if v is None or t is bool or t is str or isinstance(v, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
            return v
        raise NotCompilable(f"an argument of type {t.__name__}")

    try:
        structure = tuple(
            leaf(v, (arg_names[i] if i < len(arg_names) else None) in params) for i, v in enumerate(args)
        )
        kw = tuple((k, leaf(v, k in params)) for k, v in kwargs.items())
    finally:
        # leaf calls itself through its closure: a reference cycle that would
        # keep the call's tensors alive until the garbage collector runs.
        del leaf
    specs = tuple(tensor_spec(t) for t in tensors)

    mutated = frozenset()
    if info.mutated_args:
        mutated = frozenset(_refs_of(info, structure, kw))
        if mutated:
            storages = [t.untyped_storage().data_ptr() for t in tensors]
            for i in mutated:
                if storages.count(storages[i]) > 1:
                    raise WritesSharedMemory("an argument the op writes shares memory with another argument")
                if specs[i].stride is not None and _overlaps_itself(tensors[i]):
                    raise NotCompilable("an argument the op writes overlaps itself")
    key = (op, structure, kw, specs)
    return CallSignature(key, structure, kw, tensors, specs, floats, ints, mutated)


def _overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two elements of a view share memory. PyTorch's own check gives
    up on most strided views (x[:, :2]); sorted by stride, a view does not
    overlap when each stride steps over everything the smaller ones span."""
    verdict = torch._debug_has_internal_overlap(t)
    if verdict != 2:  # 0: no, 1: yes, 2: too hard to say
        return verdict == 1
    extent = 0  # the furthest element the smaller dims reach
    for stride, size in sorted((s, n) for n, s in zip(t.shape, t.stride()) if n > 1):
        if stride <= extent:
            return True
        extent += stride * (size - 1)
    return False


def _refs_of(info, structure, kw) -> list:
    refs = []
    wanted = set(info.mutated_args)
    for i, s in enumerate(structure):
        if i < len(info.arg_names) and info.arg_names[i] in wanted:
            refs.extend(_collect(s))
    for k, s in kw:
        if k in wanted:
            refs.extend(_collect(s))
    return refs


def _collect(s) -> list:
    if isinstance(s, TRef):
        return [s.i]
    if isinstance(s, Seq):
        return [i for x in s.items for i in _collect(x)]
    return []


def rebuild(s, tensors, floats, ints, device):
    """The argument value for a structure, given values for the references;
    neuron devices (factory ops) become `device`, where the graph is traced."""
    if isinstance(s, TRef):
        return tensors[s.i]
    if isinstance(s, FRef):
        return floats[s.j]
    if isinstance(s, IRef):
        return ints[s.j]
    if isinstance(s, Seq):
        items = [rebuild(x, tensors, floats, ints, device) for x in s.items]
        return items if s.kind == "list" else tuple(items)
    if type(s) is tuple and len(s) == 2 and (s[0] == "float" or s[0] == "complex"):
        return s[1]
    if isinstance(s, torch.device) and s.type == "neuron":
        return device
    return s


_NUMBERS = (bool, int, float, torch.SymInt, torch.SymFloat, torch.SymBool)


def _tensor_slots(op, strict: bool = False) -> tuple:
    """(positional indices, keyword names) of the op's Tensor arguments that
    need a tensor where boxed calls hand over a number. `strict`: also where
    Python accepts numbers (add, mul...)."""
    slots = _slots_cache.get((op, strict))
    if slots is None:
        schema = op._schema
        # Python accepts numbers there for a few ops (add, mul...): leave those as they are.
        lenient = not strict and torch._C._should_allow_numbers_as_tensors(schema.name.split("::")[-1])
        wanted = [(i, a.name) for i, a in enumerate(schema.arguments)
                  if str(a.type) == "Tensor" and (i == 0 or not lenient)]
        slots = _slots_cache[(op, strict)] = (frozenset(i for i, _ in wanted), frozenset(n for _, n in wanted))
    return slots


_slots_cache: dict = {}


def numbers_as_tensors(op, args, kwargs):
    """(args, kwargs) with numbers in Tensor slots turned into 0-dim tensors
    that promote as PyTorch's wrapped numbers do. Boxed calls unwrap wrapped
    scalars into Python numbers (1 - x arrives as sub.Tensor(1, x),
    x.bitwise_xor(5) as bitwise_xor.Tensor(x, 5)); neither torch-mlir nor a
    direct call of the op takes a number there."""
    # Beside a complex tensor a traced runtime number must be a real tensor
    # (PyTorch's refs turn a number into a complex one by guarding on its value).
    strict = any(isinstance(a, torch.Tensor) and a.is_complex() for a in args)
    positions, names = _tensor_slots(op, strict)
    if not any(i < len(args) and isinstance(args[i], _NUMBERS) for i in positions) and not any(
        isinstance(v, _NUMBERS) and k in names for k, v in kwargs.items()
    ):
        return args, kwargs
    others = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
    if not others:
        return args, kwargs
    tensor = others[0]
    args = tuple(_as_tensor(a, tensor) if i in positions else a for i, a in enumerate(args))
    kwargs = {k: _as_tensor(v, tensor) if k in names else v for k, v in kwargs.items()}
    return args, kwargs


def _as_tensor(value, like: torch.Tensor):
    if not isinstance(value, _NUMBERS):
        return value
    dtype = like.dtype
    if isinstance(value, (bool, torch.SymBool)):
        dtype = torch.bool
    elif isinstance(value, (float, torch.SymFloat)):
        if not (dtype.is_floating_point or dtype.is_complex):
            dtype = torch.get_default_dtype()
    elif dtype == torch.bool:
        dtype = torch.int64
    if dtype.is_complex:
        # A real number beside a complex tensor: a real 0-dim tensor promotes
        # the same way, and a traced runtime number cannot become a complex one.
        dtype = dtype.to_real()
    return torch.scalar_tensor(value, dtype=dtype, device=like.device)
