"""The one dispatch entry point for aten ops on neuron tensors (entry.py),
op mode (eager.py, cached_launch.py, plans.py, warm_start.py), the host
path every mode shares (host_fallback.py, host_threads.py, draws_ahead.py)
and the recording of op signatures (shape_recording.py)."""
