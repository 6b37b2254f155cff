"""Lowering in a separate process, for lowering that must not touch the program.

torch.export is not thread-safe: while it traces, process-wide state says so
(`torch.compiler.is_compiling()` turns true, which changes what optimizers and
other library code do in every thread), it swaps loggers and holds the GIL for
seconds. Background lowering (adaptive eager's fused graphs, and op mode's
calls whose executables build while the program runs) therefore runs in
one worker process (`python -m torchneuron.lowering.worker`, not
multiprocessing, which would re-run the user's main script) at a lower
scheduling priority; it returns MLIR text, and compiling (which releases the
GIL) stays in this process with its caches.

Protocol: length-prefixed pickles; request ("graph", spec, floats, ints) or
("call", op name, signature without its tensors, promote_scalars); reply
("ok", mlir or LoweredCall), ("resize", shapes) (NeedsResize) or
("error", message).
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import pickle
import struct
import subprocess
import sys
import threading
from typing import NamedTuple

from .. import trace
from ..compiler.pool import lower_priority
from .call import NotCompilable
from .graph import NeedsResize

_HEADER = struct.Struct("<Q")


def _write(stream, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)))
    stream.write(data)
    stream.flush()


def _read(stream):
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError("the lowering worker closed its pipe")
    (size,) = _HEADER.unpack(header)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("the lowering worker closed its pipe")
    return pickle.loads(data)


class _Worker:
    def __init__(self):
        from .. import config

        env = dict(os.environ)
        env["TORCHNEURON_LOWERING_WORKER"] = "1"
        env["TORCHNEURON_DRIVER"] = config.settings.driver  # lowering differs by target (rules/float32_moments.py)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "torchneuron.lowering.worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
        )
        # At once: its imports (torch, torchneuron) take a core for a second
        # or two, while the program's first steps run.
        lower_priority(self.process.pid)

    def ask(self, request):
        _write(self.process.stdin, request)
        kind, value = _read(self.process.stdout)
        if kind == "resize":
            raise NeedsResize(value)
        if kind != "ok":
            raise NotCompilable(value)
        return value

    def close(self) -> None:
        try:
            self.process.stdin.close()
            self.process.wait(timeout=5)
        except Exception:  # noqa: BLE001 - best effort at exit
            self.process.kill()
            self.process.wait()
        self.process.stdout.close()


_worker = None
_lock = threading.Lock()
_atexit_registered: list = []


def lower_graph_elsewhere(spec, floats, ints) -> str:
    """MLIR for a GraphSpec, lowered in the worker process."""
    from .fused import with_ops_named

    return _ask(("graph", with_ops_named(spec), list(floats), list(ints)))


def lower_call_elsewhere(op, info, sig, promote_scalars: bool = False):
    """graph.lower_call, in the worker process: a LoweredCall, or raises
    NotCompilable (NeedsResize)."""
    detached = dataclasses.replace(sig, key=None, tensors=[])
    return _ask(("call", str(op), info.name, detached, promote_scalars))


def _ask(request):
    """One request to the worker (one at a time; a worker that died is
    restarted once)."""
    global _worker
    with _lock, trace.span("lower", request[1] if request[0] == "call" else "fused graph"):
        for attempt in (1, 2):
            if _worker is None or _worker.process.poll() is not None:
                if _worker is None and not _atexit_registered:
                    _atexit_registered.append(True)
                    atexit.register(shutdown)
                _worker = _Worker()
            try:
                return _worker.ask(request)
            except (EOFError, BrokenPipeError, OSError) as e:
                _worker = None
                if attempt == 2:
                    raise NotCompilable(f"the lowering worker failed: {e}") from None
    raise AssertionError("unreachable")


def shutdown() -> None:
    global _worker
    with _lock:
        worker, _worker = _worker, None
    if worker is not None:
        worker.close()


def _serve() -> None:
    # The protocol owns the original stdout; anything torch prints goes nowhere.
    requests = os.fdopen(os.dup(0), "rb")
    replies = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    try:
        os.nice(10)
    except OSError:
        pass
    import torch

    torch.set_num_threads(1)
    _keep_decomposition_overrides()
    while True:
        try:
            request = _read(requests)
        except EOFError:
            return
        try:
            reply = ("ok", _answer(request))
        except NeedsResize as e:
            reply = ("resize", e.shapes)
        except Exception as e:  # noqa: BLE001 - every failure goes back as a reason
            reply = ("error", f"{type(e).__name__}: {e}"[:2000])
        _write(replies, reply)


def _keep_decomposition_overrides() -> None:
    """Install the overrides of composite ops that run_decompositions puts in
    place and takes away again around every call once, and keep them while
    the table asks for the same ones. Measured on the demo's 80 op
    signatures: lowering 0.40 -> 0.17 s each, the same MLIR for every one.
    Only here: the overrides change how traced code dispatches, and nothing
    but lowering runs in this process."""
    import contextlib
    import functools

    from torch.export import exported_program

    original = exported_program._override_composite_implicit_decomp
    kept = contextlib.ExitStack()
    installed = [None]

    @contextlib.contextmanager
    def kept_override(cia_ops_to_callable):
        wanted = frozenset(cia_ops_to_callable.items())
        if wanted != installed[0]:
            kept.close()
            kept.enter_context(original(cia_ops_to_callable))
            installed[0] = wanted
        yield

    exported_program._override_composite_implicit_decomp = kept_override
    exported_program._collect_all_valid_cia_ops = functools.lru_cache(None)(
        exported_program._collect_all_valid_cia_ops)


class _Named(NamedTuple):  # what lower_call reads of an op's info
    name: str


def _answer(request):
    from .fused import lower_graph, resolve_op, with_ops_resolved
    from .graph import lower_call

    if request[0] == "graph":
        _, spec, floats, ints = request
        return lower_graph(with_ops_resolved(spec), floats, ints)
    _, op_name, info_name, sig, promote_scalars = request
    return lower_call(resolve_op(op_name), _Named(info_name), sig, promote_scalars)


if __name__ == "__main__":
    _serve()
