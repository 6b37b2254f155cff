"""vLLM on neuron: a vLLM platform plugin.

vLLM finds out-of-tree hardware through the entry point group
`vllm.platform_plugins` (pyproject.toml names `register` below). The platform
(platform.py) names the device, the worker (worker.py) that puts the weights
and the paged KV cache in neuron tensors, the model runner (model_runner.py)
that pads batches to a few shapes so that every step reuses compiled
executables, and the attention backend (attention.py) over the paged cache.
Everything else is vLLM's own machinery running on a PyTorch device.

`VLLM_TARGET_DEVICE=cpu` keeps vLLM on its CPU platform in an environment
where this plugin is installed (the tests' CPU reference does so).
"""

from __future__ import annotations

PLATFORM = "torchneuron.vllm.platform.NeuronPlatform"


def register() -> str | None:
    """vLLM's platform probe: the platform's qualified name when a neuron
    device is there, else None (vLLM then picks another platform)."""
    try:
        from torchneuron import is_available  # importing registers the device

        return PLATFORM if is_available() else None
    except Exception:  # a probe must not fail vLLM's start-up
        return None
