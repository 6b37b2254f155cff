"""The remote executable store shared across hosts (Redis, through redis-py).

Consulted after the local disk and filled after each compile. It is an
optimization, never a dependency: when the server is down or stops answering,
the store warns once, steps aside for a while and everything compiles locally.

Whoever can write to the store can hand every host code to run: with a cache
secret its entries are signed and entries without a valid signature are
refused (counted as remote_untrusted, deleted, compiled here); without one
the store warns once that it is trusted by checksum only.
"""

from __future__ import annotations

import threading
import time
import warnings

from .. import config
from . import entry, trust

_PREFIX = "torchneuron:exe:"
_RETRY_AFTER = 30.0  # seconds the store stays out of the way after a failure


class RemoteStore:
    def __init__(self, url: str, timeout: float = 2.0):
        import redis

        self.url = url
        self._redis = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        self._errors = (redis.exceptions.RedisError, OSError)
        self._down_until = 0.0
        self._warned = False
        self.hits = 0
        self.misses = 0
        self.puts = 0
        self.failures = 0
        self.corrupt = 0
        self.untrusted = 0
        if trust.secret() is None:
            trust.warn_unsigned_remote(url)

    def _available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, error: Exception) -> None:
        self.failures += 1
        self._down_until = time.monotonic() + _RETRY_AFTER
        if not self._warned:
            self._warned = True
            warnings.warn(f"neuron: the remote executable cache {self.url} is unavailable ({error}); "
                          "compiling locally", RuntimeWarning, stacklevel=4)

    def get(self, key: str) -> bytes | None:
        if not self._available():
            return None
        try:
            blob = self._redis.get(_PREFIX + key)
        except self._errors as e:
            self._failed(e)
            return None
        if blob is None:
            self.misses += 1
            return None
        try:
            vmfb, _ = entry.unpack(blob, key)
        except entry.CorruptEntry as e:
            if isinstance(e, entry.UntrustedEntry):
                self.untrusted += 1
                trust.refuse("remote", f"the remote executable cache {self.url}")
            else:
                self.corrupt += 1
            try:
                self._redis.delete(_PREFIX + key)
            except self._errors:
                pass
            return None
        self.hits += 1
        return vmfb

    def put(self, key: str, vmfb: bytes, **meta) -> None:
        if not self._available():
            return
        try:
            self._redis.set(_PREFIX + key, entry.pack(key, vmfb, **meta))
            self.puts += 1
        except self._errors as e:
            self._failed(e)

    def stats(self) -> dict:
        return {"remote_hits": self.hits, "remote_misses": self.misses, "remote_puts": self.puts,
                "remote_failures": self.failures, "remote_corrupt": self.corrupt, "remote_untrusted": self.untrusted}


_remote: RemoteStore | None = None
_remote_url: str | None = None
_lock = threading.Lock()


def remote_store() -> RemoteStore | None:
    global _remote, _remote_url
    url = config.settings.remote_cache
    if url == _remote_url:
        return _remote
    with _lock:
        if url != _remote_url:
            if not url:
                _remote = None
            elif not url.startswith(("redis://", "rediss://", "unix://")):
                raise ValueError(f"TORCHNEURON_REMOTE_CACHE must be a redis:// URL, got {url!r}")
            else:
                _remote = RemoteStore(url)
            _remote_url = url
    return _remote
