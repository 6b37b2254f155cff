"""What the dispatch entry point needs to know about an op, read once from its schema."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Ops that legitimately take tensors on more than one device (as on CUDA):
# copies between devices and indexing with host indices.
_CROSS_DEVICE_OPS = frozenset(
    {
        "aten::copy_",
        "aten::_copy_from",
        "aten::_copy_from_and_resize",
        "aten::_to_copy",
        "aten::to",
        "aten::index.Tensor",
        "aten::index_put",
        "aten::index_put_",
        "aten::_index_put_impl_",
        "aten::set_",
    }
)


# Views whose schema does not say so, and in-place ops that change only a
# tensor's metadata: PyTorch's composite kernels do them without touching data.
METADATA_OPS = frozenset(
    {"aten::_unsafe_view", "aten::squeeze_", "aten::unsqueeze_", "aten::transpose_", "aten::t_",
     "aten::as_strided_", "aten::swapaxes_", "aten::swapdims_", "aten::detach_", "aten::resize_as_"}
)


@dataclass(frozen=True)
class OpInfo:
    name: str  # "aten.add.Tensor"
    arg_names: tuple  # positional argument names, for error messages
    mutated_args: tuple  # names of arguments the op writes to (in-place, out=)
    out_args: tuple  # the out= ones: written whole, never read
    seeded: bool  # draws random numbers
    checks_devices: bool  # all tensor arguments must share one device
    composite_only: bool  # PyTorch's generic kernel, no CPU kernel: can be decomposed on device
    metadata_only: bool  # changes sizes/strides only (METADATA_OPS)
    host_kernel: bool  # PyTorch has a CPU or generic kernel the host fallback can run


_cache: dict = {}
_HOST_KEYS = ("CPU", "CompositeExplicitAutograd", "CompositeImplicitAutograd", "CompositeExplicitAutogradNonFunctional")


def _has(qualified: str, key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(qualified, key)


def op_info(op) -> OpInfo:
    info = _cache.get(op)
    if info is None:
        schema = op._schema
        qualified = schema.name + ("." + schema.overload_name if schema.overload_name else "")
        info = OpInfo(
            name=str(op),
            arg_names=tuple(a.name for a in schema.arguments),
            mutated_args=tuple(
                a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write
            ),
            out_args=tuple(a.name for a in schema.arguments if a.is_out),
            seeded=torch.Tag.nondeterministic_seeded in op.tags,
            checks_devices=schema.name not in _CROSS_DEVICE_OPS and qualified not in _CROSS_DEVICE_OPS,
            composite_only=_has(qualified, "CompositeExplicitAutograd") and not _has(qualified, "CPU"),
            metadata_only=schema.name in METADATA_OPS,
            host_kernel=any(_has(qualified, k) for k in _HOST_KEYS),
        )
        _cache[op] = info
    return info
