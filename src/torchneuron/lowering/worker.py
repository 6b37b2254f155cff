"""Lowering in a separate process, for lowering that must not touch the program.

torch.export is not thread-safe: while it traces, process-wide state says so
(`torch.compiler.is_compiling()` turns true, which changes what optimizers and
other library code do in every thread), it swaps loggers and holds the GIL for
seconds. Background lowering (adaptive eager's fused graphs) therefore runs in
one worker process (`python -m torchneuron.lowering.worker`, not
multiprocessing, which would re-run the user's main script) at a lower
scheduling priority; it returns MLIR text, and compiling (which releases the
GIL) stays in this process with its caches.

Protocol: length-prefixed pickles; request (spec, floats, ints), reply
("ok", mlir) or ("error", message).
"""

from __future__ import annotations

import atexit
import os
import pickle
import struct
import subprocess
import sys
import threading

from .call import NotCompilable

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
        env = dict(os.environ)
        env["TORCHNEURON_LOWERING_WORKER"] = "1"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "torchneuron.lowering.worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
        )

    def lower(self, spec, floats, ints) -> str:
        _write(self.process.stdin, (spec, list(floats), list(ints)))
        kind, value = _read(self.process.stdout)
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
    """MLIR for a GraphSpec, lowered in the worker process (one request at a
    time; a worker that died is restarted once)."""
    from .fused import with_ops_named

    global _worker
    named = with_ops_named(spec)
    with _lock:
        for attempt in (1, 2):
            if _worker is None or _worker.process.poll() is not None:
                if _worker is None and not _atexit_registered:
                    _atexit_registered.append(True)
                    atexit.register(shutdown)
                _worker = _Worker()
            try:
                return _worker.lower(named, floats, ints)
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
    from .fused import lower_graph, with_ops_resolved

    while True:
        try:
            spec, floats, ints = _read(requests)
        except EOFError:
            return
        try:
            reply = ("ok", lower_graph(with_ops_resolved(spec), floats, ints))
        except Exception as e:  # noqa: BLE001 - every failure goes back as a reason
            reply = ("error", f"{type(e).__name__}: {e}"[:2000])
        _write(replies, reply)


if __name__ == "__main__":
    _serve()
