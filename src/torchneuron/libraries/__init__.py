"""What the libraries users train with need from this backend beyond
PyTorch's own device surface: Lightning's accelerator (lightning.py). The
libraries that detect the device themselves (Transformers, Accelerate,
Diffusers) need only the `torch_neuronx` module (src/torch_neuronx)."""
