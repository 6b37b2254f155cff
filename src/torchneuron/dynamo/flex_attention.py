"""FlexAttention on neuron tensors.

torch 2.13's flex_attention refuses devices outside a fixed list ("only
supported on CUDA, CPU, HPU, or MPS devices"; its own comment marks the check
as temporary until other devices are added). The check is widened to
neuron; under torch.compile(backend="neuron") the flex_attention operator is
decomposed by AOTAutograd into dense ATen ops (its math implementation,
masked by the block mask), which the lowering compiles like any graph.
"""

from __future__ import annotations

import functools


def allow_neuron() -> None:
    from torch.nn.attention import flex_attention as module

    original = module._validate_device
    if getattr(original, "_neuron_allowed", False):
        return

    @functools.wraps(original)
    def validate_device(query, key, value):
        if query.device.type == "neuron":
            return None
        return original(query, key, value)

    # Traced by Dynamo, not skipped with the rest of torchneuron's internals:
    # a skipped call would break the user's graph at every flex_attention.
    import torch._dynamo

    validate_device = torch._dynamo.dont_skip_tracing(validate_device)
    validate_device._neuron_allowed = True
    module._validate_device = validate_device
