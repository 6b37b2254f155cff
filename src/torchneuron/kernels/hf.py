"""Hugging Face Transformers models on the kernel library, without editing
model code:

    from torchneuron.kernels import hf
    hf.use_kernels(model)   # attention and RMSNorm through the library

Attention: a function registered with Transformers' AttentionInterface (and
the SDPA mask function, which leaves the mask out when it is only causal)
under the name "neuron_kernels"; the model is switched to it. Calls the
kernel does not take (an explicit mask, as padding makes; dropout while
training; a soft cap) run Transformers' SDPA attention. RMSNorm: modules
named *RMSNorm computing Llama's form (weight * x * rsqrt(mean(x²) + eps),
a `variance_epsilon` attribute) run the rms_norm kernel.
"""

from __future__ import annotations

import types

from .attention import flash_attention
from .norms import rms_norm

ATTENTION = "neuron_kernels"


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      is_causal=None, **kwargs):
    """Transformers' attention function signature: [batch, heads, seq, dim]
    in, [batch, seq, heads, dim] out."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    if (attention_mask is not None or (dropout and module.training) or kwargs.get("softcap") is not None
            or kwargs.get("position_bias") is not None or kwargs.get("cache") is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(causal) and query.shape[2] > 1 and query.shape[2] == key.shape[2]
    out = flash_attention(query, key, value, causal=causal, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _rms_norm_forward(self, hidden_states):
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def register() -> None:
    """Make "neuron_kernels" an attention implementation Transformers knows."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, attention_forward)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def use_kernels(model):
    """Switch a Transformers model's attention and RMSNorm modules to the
    kernel library; returns the model."""
    register()
    model.set_attn_implementation(ATTENTION)
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon") and hasattr(module, "weight"):
            module.forward = types.MethodType(_rms_norm_forward, module)
    return model


__all__ = ["ATTENTION", "attention_forward", "register", "use_kernels"]
