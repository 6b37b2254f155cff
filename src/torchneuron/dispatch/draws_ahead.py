"""Random values drawn ahead, on another core, exactly as they would be drawn now.

Random ops on neuron match CPU bit for bit: dropout's mask is CPU's bernoulli
draw from the neuron generator's state, and a torch.compile graph's random
values are CPU's torch.rand/randn draws (mt19937, serial, about 5 ns per
element: 75-150 us for each of the demo's seven masks, a tenth of CPU eager's
whole step). A training loop asks for the same sequence of draws every step,
so after each draw the next ones of the sequence are drawn ahead, from the
generator's state after this draw, on a C++ thread that never takes the GIL
(csrc/draws.cpp; a Python thread waited for the GIL at each step of its draw
and was seldom done in time).

Up to `_DEPTH` draws are made ahead, each from the state the one before it
leaves, so a step's masks are ready before its forward pass asks for them
(the first ones of a step are drawn during the previous backward pass). A
draw uses the next one made ahead only if the generator's state is then
exactly the state it was drawn from (nothing else drew, nobody reseeded) and
it was drawn for the same kind, size, dtype and probability; otherwise the
draws ahead are dropped and the draw is made now. Either way the values, and
the generator's state after them, are those of drawing now. The sequence is learned from the last `_CONTEXT` draws (a
loop's sequence repeats; a context met for the first time draws nothing
ahead, an ambiguous one guesses its latest successor).
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections import deque

import torch

from .. import _C
from . import host_threads

_CONTEXT = 8  # draws of history that predict the next
_DEPTH = 8  # draws made ahead at most
_MAX_ELEMENTS = 1 << 22  # elements drawn ahead at most (on a guess)
_MAX_CONTEXTS = 4096

_lock = threading.Lock()
_history: list = []  # keys (kind, numel, dtype, param, generator id) of the last draws, newest last
_next_of: dict = {}  # tuple of the last _CONTEXT keys -> the key drawn next
_chain: deque = deque()  # (key, _C.PendingDraw) drawn ahead, in order
_chain_from = None  # the generator state the chain's first draw is drawn from
MASK, UNIFORM, NORMAL = 0, 1, 2  # kinds of draws (csrc/draws.cpp)
_LIKE: dict = {}  # dtype -> an empty tensor of it (the C++ draw takes its options)
_setup_done = False
counts = {"ahead": 0, "now": 0}  # draws served from ahead / made at the call


def _like(dtype):
    like = _LIKE.get(dtype)
    if like is None:
        like = _LIKE[dtype] = torch.empty(0, dtype=dtype)
    return like


def _setup() -> None:
    global _setup_done
    if not _setup_done:
        # The drawing thread sets its own OpenMP/MKL thread count to one (host_threads.py).
        _C.set_draw_thread_setup([ctypes.cast(fn, ctypes.c_void_p).value for fn in host_threads._thread_count_setters()])
        _setup_done = True


def dropout_mask(shape, dtype, keep: float, generator: torch.Generator) -> torch.Tensor:
    """CPU's dropout mask of `shape` (bool, on the host): bernoulli(keep)
    drawn in `dtype` from `generator`, whose state moves on as CPU's would."""
    return draw(MASK, shape, dtype, keep, generator)


def draw(kind: int, shape, dtype, param: float, generator: torch.Generator) -> torch.Tensor:
    """CPU's draw of `kind` (MASK with probability `param`; UNIFORM:
    torch.rand; NORMAL: torch.randn) of `shape`, on the host, from
    `generator`, whose state moves on as CPU's would."""
    global _chain_from
    numel = 1
    for s in shape:
        numel *= s
    key = (kind, numel, dtype, param, id(generator))
    state = generator.get_state()
    with _lock:
        if len(_history) >= _CONTEXT:
            if len(_next_of) >= _MAX_CONTEXTS:
                _next_of.clear()
            _next_of[tuple(_history)] = key
            del _history[0]
        _history.append(key)
        found = None
        if _chain and _chain[0][0] == key and torch.equal(_chain_from, state):
            # (a draw that failed ahead raises here, as the same draw made now would)
            found = _chain.popleft()[1].result()
        if found is None:
            _chain.clear()
            counts["now"] += 1
            found = _C.draw_values(state, kind, numel, _like(dtype), param)
        else:
            counts["ahead"] += 1
        values, after = found
        generator.set_state(after)
        _chain_from = after
        _extend(key[4])
    return values.view(shape)


def _extend(generator_id) -> None:
    """Draw ahead what the learned sequence says comes next (caller holds the lock)."""
    if len(_history) < _CONTEXT or len(_chain) >= _DEPTH:
        return
    context = _history + [k for k, _ in _chain]
    elements = sum(k[1] for k, _ in _chain)
    while len(_chain) < _DEPTH:
        following = _next_of.get(tuple(context[-_CONTEXT:]))
        if following is None or following[4] != generator_id or elements + following[1] > _MAX_ELEMENTS:
            return
        _setup()
        kind, numel, dtype, param, _ = following
        if _chain:
            pending = _C.draw_values_after(_chain[-1][1], kind, numel, _like(dtype), param)
        else:
            pending = _C.draw_values_ahead(_chain_from, kind, numel, _like(dtype), param)
        _chain.append((following, pending))
        context.append(following)
        elements += numel


def forget() -> None:
    """Drop what was learned and what was drawn ahead."""
    with _lock:
        _chain.clear()
        _history.clear()
        _next_of.clear()


# A forked child has no drawing thread (csrc/draws.cpp makes it a new one):
# what the parent's drew ahead never arrives there.
os.register_at_fork(after_in_child=lambda: (_chain.clear(), _history.clear()))
