"""Run a function right after a module is first imported.

Lightning registers accelerators only from its own modules and reads its
registry when a Trainer is built, so the neuron accelerator must be
registered after Lightning's modules load and before user code builds a
Trainer, without the user importing anything. This finder sits first on
`sys.meta_path`, lets the other finders locate the watched module, and wraps
its loader so that the hook runs once the module has executed. A module
already imported gets its hook at once."""

from __future__ import annotations

import importlib.abc
import sys


class _LoaderThenHook(importlib.abc.Loader):
    def __init__(self, loader, hook):
        self._loader, self._hook = loader, hook

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._hook(module)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self):
        self.hooks = {}

    def find_spec(self, name, path=None, target=None):
        hook = self.hooks.pop(name, None)
        if hook is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _LoaderThenHook(spec.loader, hook)
                return spec
        return None


_finder = _Finder()


def when_imported(name: str, hook) -> None:
    """Call `hook(module)` once module `name` is imported (now if it is already)."""
    if name in sys.modules:
        hook(sys.modules[name])
        return
    _finder.hooks[name] = hook
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
