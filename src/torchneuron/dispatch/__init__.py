"""The one dispatch entry point for aten ops on neuron tensors, and how ops run."""
