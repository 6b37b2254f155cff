"""A process's connection to the compile service.

Any failure to reach the service, or a service that dies mid-request, raises
ServiceUnavailable: the caller compiles locally. After a failure the service
is left alone for a while, so a dead service costs one warning, not a
connection attempt per op.
"""

from __future__ import annotations

import threading
import time
import warnings

from .. import config
from . import protocol

_RETRY_AFTER = 10.0


class ServiceUnavailable(ConnectionError):
    pass


class ServiceClient:
    def __init__(self, address: str):
        self.address = address
        self._local = threading.local()  # one connection per thread
        self._down_until = 0.0
        self._warned = False
        self.requests = 0
        self.failures = 0

    def _connection(self):
        sock = getattr(self._local, "sock", None)
        if sock is None:
            sock = self._local.sock = protocol.connect(self.address, timeout=config.settings.cache_lock_timeout)
        return sock

    def _drop(self) -> None:
        sock = getattr(self._local, "sock", None)
        self._local.sock = None
        if sock is not None:
            sock.close()

    def call(self, header: dict, payload: bytes = b"") -> tuple:
        if time.monotonic() < self._down_until:
            raise ServiceUnavailable(f"the compile service {self.address} failed recently")
        self.requests += 1
        try:
            sock = self._connection()
            protocol.send(sock, header, payload)
            reply, data = protocol.recv(sock)
        except (OSError, ValueError) as e:  # refused, reset, EOF mid-reply, timeout, garbage
            self._drop()
            self.failures += 1
            self._down_until = time.monotonic() + _RETRY_AFTER
            if not self._warned:
                self._warned = True
                warnings.warn(f"neuron: the compile service {self.address} is unavailable ({e}); "
                              "compiling locally", RuntimeWarning, stacklevel=3)
            raise ServiceUnavailable(str(e)) from None
        return reply, data

    def compile(self, key: str, mlir: str, what: str, target: tuple) -> tuple:
        """(vmfb, seconds, source at the service). Raises CompileError for the
        compiler's verdict, ServiceUnavailable for anything else."""
        from ..cache import entry
        from ..compiler import CompileError

        backend, flags = target
        reply, data = self.call(
            {"op": "compile", "key": key, "what": what, "backend": backend, "flags": list(flags)}, mlir.encode()
        )
        if reply.get("status") == "compile_error":
            raise CompileError(what, reply.get("diagnostic", ""))
        if reply.get("status") != "ok":
            error = reply.get("error", "the compile service refused the request")
            if not self._warned:
                self._warned = True
                warnings.warn(f"neuron: the compile service {self.address} refused a request ({error}); "
                              "compiling locally", RuntimeWarning, stacklevel=3)
            raise ServiceUnavailable(error)
        try:
            vmfb, _ = entry.unpack(data, key)
        except entry.CorruptEntry as e:
            raise ServiceUnavailable(f"a corrupt reply ({e})") from None
        return vmfb, float(reply.get("seconds", 0.0)), reply.get("source", "compiled")

    def health(self) -> dict:
        reply = self.call({"op": "health"})[0]
        reply.pop("payload", None)
        return reply


_client: ServiceClient | None = None
_lock = threading.Lock()


def service_client() -> ServiceClient | None:
    global _client
    address = config.settings.compile_service
    if not address:
        return None
    if _client is None or _client.address != address:
        with _lock:
            if _client is None or _client.address != address:
                _client = ServiceClient(address)
    return _client
