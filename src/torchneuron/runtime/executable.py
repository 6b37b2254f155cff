"""An IREE executable loaded once per device: VM module, context, entry function."""

from __future__ import annotations

import threading


class LoadedExecutable:
    """The compiled module of one op signature; loaded lazily on each device it runs on."""

    def __init__(self, vmfb: bytes, key: str, what: str):
        self.vmfb = vmfb
        self.key = key
        self.what = what
        self._contexts: dict = {}  # lane -> (context, async entry function)
        self._lock = threading.Lock()

    def release(self) -> None:
        """Drop the loaded contexts (at shutdown); the next entry() reloads."""
        with self._lock:
            self._contexts.clear()

    def entry(self, lane):
        """(context, function) on a queue lane (runtime.queue.Lane), loaded once."""
        loaded = self._contexts.get(lane)
        if loaded is None:
            with self._lock:
                loaded = self._contexts.get(lane)
                if loaded is None:
                    import iree.runtime as ireert

                    from .queue import _vm_instance

                    instance = _vm_instance()
                    module = ireert.VmModule.copy_buffer(instance, self.vmfb)
                    context = ireert.VmContext(instance, modules=[lane.hal_module, module])
                    # An inline lane runs the synchronous entry; the task lane
                    # the asynchronous one, which takes a wait and a signal fence.
                    name = "main" if lane.inline else "main$async"
                    fn = module.lookup_function(name)
                    if fn is None:
                        raise RuntimeError(f"neuron: executable for {self.what} has no {name} entry point")
                    loaded = self._contexts[lane] = (context, fn)
        return loaded
