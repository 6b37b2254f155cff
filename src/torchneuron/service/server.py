"""`torchneuron compile-service`: pooled compiling for every process on a host.

Requests for a key already being compiled join that compile (merged); new
keys go to a bounded pool of workers (default: cores minus one), so many
ranks starting at once do not overload the host. Results go through the same
layers as in a client (disk, remote store), so the service also answers from
the cache. It compiles with the flags each client sent, which name the
client's CPU; it never resolves "host" itself (that would be its own CPU).
It listens on a unix socket (mode 0600) or on loopback by default.

Its replies are code its clients run. With a cache secret, every connection
must first prove it holds the secret (protocol.py's handshake, on every
transport) and every executable it sends is signed. Without one it serves
only a unix socket or loopback: on any other address it refuses to start.
"""

from __future__ import annotations

import os
import socketserver
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from ..cache import service_protocol as protocol

_HANDSHAKE_TIMEOUT = 30.0  # seconds a peer has to prove itself before it is dropped


class CompileService:
    def __init__(self, workers: int | None = None):
        self.workers = workers or max(1, (os.cpu_count() or 2) - 1)
        self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="neuron-service")
        self._inflight: dict = {}
        self._lock = threading.Lock()
        self.started = time.time()
        self.counts = {"requests": 0, "merged": 0, "compiles": 0, "cache_hits": 0, "compile_errors": 0,
                       "refused": 0, "unauthorized": 0, "queued": 0, "running": 0}
        self.compile_seconds = 0.0

    def _count(self, name: str, delta: int = 1) -> None:
        with self._lock:
            self.counts[name] += delta

    def compile(self, key: str, mlir: str, what: str, target: tuple) -> tuple:
        """(vmfb, seconds, source); raises CompileError. Compiles with the
        client's flags as sent: they name the client's CPU, never this one."""
        from ..cache.key import cache_key
        from ..compiler.target_cpu import names_host

        host_flag = names_host(target[1])
        if host_flag is not None:
            # An old client: "host" here would mean this machine's CPU, not its own.
            self._count("refused")
            raise ValueError(f"the flag {host_flag} names no CPU: this service would compile for its own "
                             "CPU, not the client's; upgrade the client so it sends its resolved CPU")
        if cache_key(mlir, *target) != key:
            self._count("refused")
            raise KeyError("the key does not match this service's compiler or torchneuron version")
        with self._lock:
            self.counts["requests"] += 1
            future = self._inflight.get(key)
            if future is not None:
                self.counts["merged"] += 1
            else:
                future = self._inflight[key] = Future()
                self.counts["queued"] += 1
                self._executor.submit(self._run, future, key, mlir, what, target)
        return future.result()

    def _run(self, future: Future, key, mlir, what, target) -> None:
        from ..cache.layers import fetch_or_compile

        with self._lock:
            self.counts["queued"] -= 1
            self.counts["running"] += 1
        try:
            result = fetch_or_compile(key, mlir, what, target, use_service=False)
        except BaseException as e:  # noqa: BLE001 - handed to every merged request
            with self._lock:
                self.counts["compile_errors"] += 1
            future.set_exception(e)
        else:
            with self._lock:
                if result[2] == "compiled":
                    self.counts["compiles"] += 1
                    self.compile_seconds += result[1]
                else:
                    self.counts["cache_hits"] += 1
            future.set_result(result)
        finally:
            with self._lock:
                self.counts["running"] -= 1
                del self._inflight[key]

    def health(self) -> dict:
        from ..version import __version__
        from ..compiler import compiler_version

        with self._lock:
            return {
                "status": "ok", "pid": os.getpid(), "workers": self.workers,
                "uptime_s": round(time.time() - self.started, 1),
                "torchneuron": __version__, "compiler": compiler_version(),
                "queue_depth": self.counts["queued"], **self.counts,
                "compile_seconds": round(self.compile_seconds, 3),
            }


class _Handler(socketserver.BaseRequestHandler):
    def handle(self):
        from ..compiler import CompileError

        service: CompileService = self.server.service
        sock = self.request
        if self.server.secret is not None:
            sock.settimeout(_HANDSHAKE_TIMEOUT)
            try:
                proven = protocol.server_handshake(sock, self.server.secret)
            except (OSError, ValueError):
                proven = False
            if not proven:
                service._count("unauthorized")
                return
            sock.settimeout(None)
        while True:
            try:
                header, payload = protocol.recv(sock)
            except (OSError, ValueError):
                return  # the client went away
            op = header.get("op")
            data = b""
            if op == "health":
                reply = service.health()
            elif op == "hello":  # a client with a secret, and this service has none
                reply = {"status": "error", "error": "this compile service has no cache secret, so it cannot "
                         "prove who it is or sign its executables (start it with TORCHNEURON_CACHE_SECRET)"}
            elif op == "compile":
                from ..cache import entry

                key = str(header.get("key", ""))
                try:
                    target = (str(header["backend"]), tuple(str(f) for f in header["flags"]))
                    vmfb, seconds, source = service.compile(key, payload.decode(), str(header.get("what", "")), target)
                    reply = {"status": "ok", "seconds": seconds, "source": source}
                    data = entry.pack(key, vmfb)
                except CompileError as e:
                    reply = {"status": "compile_error", "diagnostic": e.diagnostic}
                except Exception as e:  # noqa: BLE001 - reported to the client, which compiles itself
                    reply = {"status": "error", "error": f"{type(e).__name__}: {e}"}
            else:
                reply = {"status": "error", "error": f"unknown request {op!r}"}
            try:
                protocol.send(sock, reply, data)
            except OSError:
                return


class _UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


class _TCPServer(socketserver.ThreadingMixIn, socketserver.TCPServer):
    daemon_threads = True
    allow_reuse_address = True


def serve(address: str, workers: int | None = None, ready=None) -> None:
    """Serve until interrupted. `ready(address)` is called once listening.
    Raises trust.SecretError for a non-loopback address without a secret."""
    import socket

    from ..cache import trust

    family, sockaddr = protocol.parse_address(address)
    secret = trust.secret()
    if family != socket.AF_UNIX and secret is None and not trust.is_loopback(sockaddr[0]):
        raise trust.SecretError(
            f"refusing to listen on {address} without a cache secret: it is not a loopback address, and "
            "anyone who can reach it could send code to every client. Set TORCHNEURON_CACHE_SECRET or "
            "TORCHNEURON_CACHE_SECRET_FILE (the same in the service and its clients), or listen on a unix "
            "socket or 127.0.0.1")
    if family == socket.AF_UNIX:
        directory = os.path.dirname(os.path.abspath(sockaddr))
        os.makedirs(directory, mode=0o700, exist_ok=True)
        if os.path.exists(sockaddr):
            try:  # a live service already owns it: do not steal its socket
                protocol.connect(sockaddr, timeout=1).close()
                raise RuntimeError(f"neuron: a compile service is already listening on {sockaddr}")
            except OSError:
                os.unlink(sockaddr)  # left behind by a service that died
        old = os.umask(0o177)
        try:
            server = _UnixServer(sockaddr, _Handler)
        finally:
            os.umask(old)
    else:
        server = _TCPServer(sockaddr, _Handler)
    server.service = CompileService(workers)
    server.secret = secret
    if ready is not None:
        ready(address)
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
        if family == socket.AF_UNIX:
            try:
                os.unlink(sockaddr)
            except OSError:
                pass
