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


@functools.lru_cache(maxsize=1)
def dense_attention() -> dict:
    """FlexAttention's operators -> their math implementations (scores
    materialized, score_mod and mask applied with vmap, as PyTorch runs them
    on CPU), which export traces into ATen ops the lowering compiles whole;
    the operators themselves do not lower (torch-mlir cannot legalize them)."""
    flex = _flex_module()
    return {flex.flex_attention: dense_flex_attention, flex.flex_attention_backward: dense_flex_attention_backward}


def _flex_module():
    import importlib

    return importlib.import_module("torch._higher_order_ops.flex_attention")  # the package exports the HOP by this name


# Module-level functions, so that the graph's generated code names them here
# (the math implementations' own module path resolves to the operator).
def dense_flex_attention(*args):
    return _flex_module().sdpa_dense(*args)


def dense_flex_attention_backward(*args):
    return _flex_module().sdpa_dense_backward(*args)
