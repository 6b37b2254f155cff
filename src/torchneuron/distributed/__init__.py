"""torch.distributed on neuron: a c10d backend for neuron tensors.

`dist.init_process_group()` (no backend: the accelerator's), `"neuron"`,
`"cpu:gloo,neuron:neuron"` or plain `"gloo"` give neuron tensors collectives;
DDP, FSDP2, DeviceMesh, DTensor and the functional collectives all reach them
through PyTorch's c10d ops. The transport is gloo (it ships with torch); on
the unified memory model (the CPU target) gloo reads and writes the tensors'
memory in place, on the discrete one it works on host copies (collectives.py).
"""

from __future__ import annotations

import datetime

BACKEND = "neuron"


def _create_backend(store, rank: int, size: int, timeout: datetime.timedelta):
    """The backend object the process group holds for neuron tensors: gloo,
    which collectives.py drives with the tensors' host aliases or copies."""
    from torch.distributed import ProcessGroupGloo

    return ProcessGroupGloo(store, rank, size, timeout)


def register() -> None:
    """Register the backend and the collectives' neuron kernels (at import)."""
    import torch.distributed as dist

    if not dist.is_available() or BACKEND in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(BACKEND, _create_backend, devices=["neuron"])
    # Code written for CPU tensors says "gloo": let it cover neuron tensors too.
    capability = dist.Backend.backend_capability.get(dist.Backend.GLOO)
    if capability is not None and "neuron" not in capability:
        capability.append("neuron")
    from ..lowering.opaque import register_opaque_namespace
    from . import collectives

    collectives.install()
    # A torch.compile graph with functional collectives (compiled DDP, FSDP2,
    # DTensor) is compiled in pieces around them; they run in graph order.
    for namespace in ("_c10d_functional", "_c10d_functional_autograd"):
        register_opaque_namespace(namespace)
