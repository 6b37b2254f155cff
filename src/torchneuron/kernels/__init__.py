"""The kernel library: operators written in the kernel language
(torchneuron.kernel), each with a pure-PyTorch reference it is tested
against. They work on neuron tensors in every execution mode, on CPU
tensors through the simulator, and as single nodes under torch.compile.

    from torchneuron import kernels
    y = kernels.rms_norm(x, weight)
    o = kernels.flash_attention(q, k, v, causal=True)
    o = kernels.paged_attention(q, kv_cache, block_table, context_lens, query_lens)

Shapes a kernel does not take (see each function) run the reference.
"""

from .attention import flash_attention, flash_attention_reference
from .losses import cross_entropy, cross_entropy_reference
from .moe import moe, moe_reference, moe_routed, moe_routed_reference
from .norms import add_rms_norm, add_rms_norm_reference, rms_norm, rms_norm_reference
from .paged_attention import paged_attention, paged_attention_reference
from .rows import log_softmax, log_softmax_reference, softmax, softmax_reference
from .rotary import rotary, rotary_reference
from .swiglu import swiglu, swiglu_reference

REFERENCES = {
    "rms_norm": rms_norm_reference, "add_rms_norm": add_rms_norm_reference, "softmax": softmax_reference,
    "log_softmax": log_softmax_reference, "flash_attention": flash_attention_reference,
    "cross_entropy": cross_entropy_reference, "rotary": rotary_reference, "swiglu": swiglu_reference,
    "moe": moe_reference, "moe_routed": moe_routed_reference, "paged_attention": paged_attention_reference,
}

__all__ = ["REFERENCES", "add_rms_norm", "cross_entropy", "flash_attention", "log_softmax", "moe", "moe_routed",
           "paged_attention", "rms_norm", "rotary", "softmax", "swiglu",
           *[f"{n}_reference" for n in ("add_rms_norm", "cross_entropy", "flash_attention", "log_softmax", "moe",
                                        "moe_routed", "paged_attention", "rms_norm", "rotary", "softmax", "swiglu")]]
