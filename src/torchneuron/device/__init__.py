"""The `torch.neuron` surface: the device module (module.py) with the
functions torch.cuda users expect. Registering the device with PyTorch is
the composition root's work (registration.py)."""
