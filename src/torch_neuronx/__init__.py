"""`torch_neuronx`: the import name the PyTorch ecosystem looks for.

Transformers, Accelerate and Diffusers choose the neuron device when the
module `torch_neuronx` exists and `torch.neuron.is_available()` (their
`is_torch_neuron_available` / `is_neuron_available` checks), as they choose
CUDA when it is there. This package is that name over torchneuron: importing
it registers the device (as `import torch` does through the autoload entry
point) and offers the functions of `torch.neuron` under the names the
system torchneuron implements documents (`torch_neuronx.Stream`,
`torch_neuronx.synchronize`, ...). It cannot be installed beside AWS's own
`torch-neuronx`: both provide this module.
"""

from __future__ import annotations

import torchneuron as _torchneuron
from torchneuron.device.module import (  # noqa: F401 - the public surface, as torch.neuron's
    Event,
    Stream,
    current_device,
    current_stream,
    default_stream,
    device,
    device_count,
    empty_cache,
    get_device_name,
    get_device_properties,
    is_available,
    is_bf16_supported,
    is_initialized,
    manual_seed,
    manual_seed_all,
    max_memory_allocated,
    mem_get_info,
    memory_allocated,
    memory_reserved,
    memory_stats,
    reset_peak_memory_stats,
    set_device,
    set_stream,
    stream,
    synchronize,
)

__version__ = _torchneuron.__version__
