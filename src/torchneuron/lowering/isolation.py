"""Lowering must not see the program's modes.

An op can reach the lowering while the program has TorchDispatchModes or
TorchFunctionModes active: a user's FlopCounterMode or `with
torch.device(...)`, or AOTAutograd's runtime, which runs compiled graphs
under a dispatch mode that analyses custom ops. Tracing an op for export (or
for its result shapes) under such a mode records the mode's behaviour, not
the op's, and the wrong executable would be cached on disk for every later
process. Every trace the lowering makes runs with those modes set aside,
and outside any torch.compile tracing context.
"""

from __future__ import annotations

import contextlib

import torch
from torch._C._dynamo.eval_frame import set_eval_frame
from torch.overrides import _get_current_function_mode_stack, _pop_mode, _push_mode
from torch.utils._python_dispatch import _disable_current_modes, _len_torch_dispatch_stack


_KEY, _KEYS = torch._C.DispatchKey, torch._C.DispatchKeySet
# A program's thread state: the dispatcher's default include set, autocast off. An op reaches the
# lowering from inside the dispatcher (below autograd, or inside a mode's
# handler, which excludes every key above Python, functionalization
# included), and export must trace from the top as a program would.
_DEFAULT_INCLUDED = _KEYS(_KEY.BackendSelect) | _KEYS(_KEY.ADInplaceOrView)
_AUTOCAST_KEYS = _KEYS(_KEY.AutocastCPU)
for _name in dir(_KEY):
    if _name.startswith("Autocast"):
        _AUTOCAST_KEYS = _AUTOCAST_KEYS | _KEYS(getattr(_KEY, _name))


@contextlib.contextmanager
def outside_program_modes():
    # No tracing or compile context either: inside a torch.compile backend,
    # export would otherwise trace with Dynamo's fake mode and shape
    # environment, and specialize the program's dynamic sizes. And no Dynamo
    # frame callback: an op lowered while a compiled frame runs would have
    # Dynamo compile the lowering's own Python (export, the importer).
    prior = set_eval_frame(None)
    try:
        with torch._C._ForceDispatchKeyGuard(_DEFAULT_INCLUDED, _AUTOCAST_KEYS), _outside_modes(), \
                torch._guards.tracing(None), torch._guards.compile_context(None):
            yield
    finally:
        set_eval_frame(prior)


@contextlib.contextmanager
def _outside_modes():
    function_modes = []
    if _get_current_function_mode_stack():
        for _ in range(len(_get_current_function_mode_stack())):
            function_modes.append(_pop_mode())
    try:
        if _len_torch_dispatch_stack():
            with _disable_current_modes():
                yield
        else:
            yield
    finally:
        for mode in reversed(function_modes):
            _push_mode(mode)
