"""Evaluation: conformance against PyTorch's OpInfo database (more to come:
shape registry, generated tests, model census, staged runs)."""
