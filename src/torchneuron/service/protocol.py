"""The compile service's wire format: length-prefixed JSON headers, each
followed by an optional binary payload (MLIR in, an executable out).
JSON and raw bytes only: nothing received is ever unpickled.

    u32 header length | JSON header {"op": ..., "payload": n, ...} | n bytes
"""

from __future__ import annotations

import json
import os
import socket
import struct

_MAX_HEADER = 1 << 20
_MAX_PAYLOAD = 1 << 31


def default_address() -> str:
    """A unix socket in the (private) cache directory."""
    from .. import config

    return os.path.join(config.settings.cache_dir or os.path.expanduser("~/.cache/torchneuron"), "compile-service.sock")


def parse_address(address: str) -> tuple:
    """(family, sockaddr): a path is a unix socket, host:port is TCP."""
    if address.startswith("unix:"):
        return socket.AF_UNIX, address[5:]
    if "/" in address or ":" not in address:
        return socket.AF_UNIX, address
    host, _, port = address.rpartition(":")
    return socket.AF_INET, (host.strip("[]") or "127.0.0.1", int(port))


def connect(address: str, timeout: float | None) -> socket.socket:
    family, sockaddr = parse_address(address)
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(sockaddr)
    except BaseException:
        sock.close()
        raise
    return sock


def send(sock: socket.socket, header: dict, payload: bytes = b"") -> None:
    raw = json.dumps(dict(header, payload=len(payload))).encode()
    sock.sendall(struct.pack(">I", len(raw)) + raw)
    if payload:
        sock.sendall(payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise ConnectionError("the connection closed mid-message")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def recv(sock: socket.socket) -> tuple:
    """(header, payload); ConnectionError when the peer is gone."""
    (n,) = struct.unpack(">I", _recv_exact(sock, 4))
    if n > _MAX_HEADER:
        raise ConnectionError("oversized header")
    header = json.loads(_recv_exact(sock, n))
    size = header.get("payload", 0)
    if not isinstance(size, int) or not 0 <= size < _MAX_PAYLOAD:
        raise ConnectionError("bad payload size")
    return header, _recv_exact(sock, size) if size else b""
