"""nk.op: a kernel as a PyTorch operator (torch.library), so it works on
neuron tensors in op mode and adaptive eager (the launch queues after what
adaptive eager recorded), on CPU tensors through the simulator, with fake
tensors (torch.compile, torch.export) and with autograd when a backward is
given. `torch.library.opcheck` passes on it.
"""

from __future__ import annotations

import inspect

import torch

from ..lowering.opaque import register_opaque
from .jit import Kernel
from .language import KernelError, constexpr

_libraries: dict = {}  # namespace -> torch.library.Library (kept alive)


def op(name: str, kernel: Kernel, *, outputs, grid, constants=None, attributes=None, backward=None,
       setup_context=None):
    """Register `kernel` as the operator `name` ("namespace::op_name").

    The kernel's parameters not annotated `nk.constexpr` are tensors: the
    operator's inputs, then its outputs. `outputs(*inputs)` gives each
    output's (shape, dtype); `grid(*inputs)` the launch grid;
    `constants(*inputs)` the constexpr values (a dict). `backward` and
    `setup_context` are torch.library.register_autograd's. `attributes`
    ({name: "float" | "int" | "bool"}) are the operator's arguments after its
    tensors, passed to outputs, grid and constants (which make them the
    kernel's constants). Returns the operator (torch.ops.namespace.op_name)."""
    if not isinstance(kernel, Kernel):
        raise KernelError("nk.op takes an @nk.jit kernel")
    if "::" not in name:
        raise KernelError(f"an operator name is 'namespace::name', got {name!r}")
    namespace, op_name = name.split("::", 1)
    tensors = [p.name for p in kernel.signature.parameters.values() if p.annotation not in (constexpr, "nk.constexpr")]
    attributes = dict(attributes or {})
    n_in = len(inspect.signature(outputs).parameters) - len(attributes)  # outputs(*inputs, *attributes)
    probe = len(tensors) - n_in
    if n_in <= 0 or probe <= 0:
        raise KernelError(f"kernel {kernel.fn.__name__} has {len(tensors)} tensor parameters; outputs() takes "
                          f"{n_in} inputs, which leaves {probe} outputs")
    inputs = tensors[:n_in]
    returns = "Tensor" if probe == 1 else "(" + ", ".join("Tensor" for _ in range(probe)) + ")"
    library = _libraries.get(namespace)
    if library is None:
        library = _libraries[namespace] = torch.library.Library(namespace, "FRAGMENT")
    params = [f"Tensor {n}" for n in inputs] + [f"{kind} {n}" for n, kind in attributes.items()]
    library.define(f"{op_name}({', '.join(params)}) -> {returns}")

    def results(args, device):
        return [torch.empty(tuple(shape), dtype=dtype, device=device) for shape, dtype in outputs(*args)]

    def finish(outs):
        return outs[0] if probe == 1 else tuple(outs)

    def on_neuron(*args):
        outs = results(args, args[0].device)
        kernel[grid(*args)](*args[:n_in], *outs, **(constants(*args) if constants else {}))
        return finish(outs)

    def on_cpu(*args):
        from .jit import simulate
        outs = results(args, "cpu")
        simulate(kernel)[grid(*args)](*[a.contiguous() for a in args[:n_in]], *outs,
                                      **(constants(*args) if constants else {}))
        return finish(outs)

    def fake(*args):
        return finish(results(args, args[0].device))

    register_opaque(name)  # torch.compile graphs run it as itself, between their compiled pieces
    library.impl(op_name, on_neuron, "PrivateUse1")
    library.impl(op_name, on_cpu, "CPU")
    torch.library.register_fake(name, fake, lib=library)
    if backward is not None:
        torch.library.register_autograd(name, backward, setup_context=setup_context, lib=library)
    return getattr(getattr(torch.ops, namespace), op_name)


__all__ = ["op"]
