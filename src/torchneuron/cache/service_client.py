"""A process's connection to the compile service.

Any failure to reach the service, or a service that dies mid-request, raises
ServiceUnavailable: the caller compiles locally. After a failure the service
is left alone for a while, so a dead service costs one warning, not a
connection attempt per op.

With a cache secret, each connection opens with the handshake (the client
and the service prove to each other that they hold it) and an executable in a
reply is loaded only with a valid signature; a service that cannot prove it,
or refuses this process, is treated like one that is down.
"""

from __future__ import annotations

import threading
import time
import warnings

from .. import config
from . import service_protocol as protocol
from . import trust

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

    def _connection(self, secret: bytes | None):
        sock = getattr(self._local, "sock", None)
        if sock is None:
            sock = protocol.connect(self.address, timeout=config.settings.cache_lock_timeout)
            if secret is not None:
                try:
                    protocol.client_handshake(sock, secret)
                except BaseException:
                    sock.close()
                    raise
            self._local.sock = sock
        return sock

    def _drop(self) -> None:
        sock = getattr(self._local, "sock", None)
        self._local.sock = None
        if sock is not None:
            sock.close()

    def call(self, header: dict, payload: bytes = b"") -> tuple:
        if time.monotonic() < self._down_until:
            raise ServiceUnavailable(f"the compile service {self.address} failed recently")
        secret = trust.secret()  # a misconfigured secret is raised, not taken for a service that is down
        self.requests += 1
        try:
            sock = self._connection(secret)
            protocol.send(sock, header, payload)
            reply, data = protocol.recv(sock)
            if reply.get("status") == "unauthorized":  # a service with a secret, this process without
                raise trust.AuthError(reply.get("error", "the compile service refused this process"))
        except (OSError, ValueError) as e:  # refused, reset, EOF mid-reply, timeout, garbage, no shared secret
            self._give_up(e)
            raise ServiceUnavailable(str(e)) from None
        return reply, data

    def _give_up(self, error: Exception, warn: bool = True) -> None:
        """Leave the service alone for a while; warn the first time."""
        self._drop()
        self.failures += 1
        self._down_until = time.monotonic() + _RETRY_AFTER
        if warn and not self._warned:
            self._warned = True
            problem = ("does not share this process's cache secret" if isinstance(error, trust.AuthError)
                       else "is unavailable")
            warnings.warn(f"neuron: the compile service {self.address} {problem} ({error}); "
                          "compiling locally", RuntimeWarning, stacklevel=4)

    def compile(self, key: str, mlir: str, what: str, target: tuple) -> tuple:
        """(vmfb, seconds, source at the service). Raises CompileError for the
        compiler's verdict, ServiceUnavailable for anything else."""
        from . import entry
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
        except entry.UntrustedEntry as e:
            # Someone between here and the service, or a service without our secret.
            self._give_up(e, warn=False)  # refuse() warns
            trust.refuse("service", f"the compile service {self.address}")
            raise ServiceUnavailable(f"an unsigned reply ({e})") from None
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
