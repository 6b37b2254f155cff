"""The compile service's wire format: length-prefixed JSON headers, each
followed by an optional binary payload (MLIR in, an executable out).
JSON and raw bytes only: nothing received is ever unpickled.

    u32 header length | JSON header {"op": ..., "payload": n, ...} | n bytes

With a cache secret, a connection opens with a handshake in which each side
proves it holds the secret without sending it (HMACs of fresh nonces):

    client: {"op": "hello", "nonce": Nc}
    server: {"status": "challenge", "nonce": Ns}
    client: {"op": "auth", "proof": HMAC(client, Ns, Nc)}
    server: {"status": "ok", "proof": HMAC(server, Ns, Nc)}   (or "unauthorized", then closes)

A server with a secret answers anything else first with "unauthorized" and
closes; one without answers "hello" with an error, so a client that has a
secret never waits for a challenge that will not come.
"""

from __future__ import annotations

import json
import os
import socket
import struct

_MAX_HEADER = 1 << 20
_MAX_PAYLOAD = 1 << 31
_MAX_UNAUTHENTICATED = 1 << 24  # what a server reads from a peer that has not proven itself


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


def recv(sock: socket.socket, max_payload: int = _MAX_PAYLOAD) -> tuple:
    """(header, payload); ConnectionError when the peer is gone."""
    (n,) = struct.unpack(">I", _recv_exact(sock, 4))
    if n > _MAX_HEADER:
        raise ConnectionError("oversized header")
    header = json.loads(_recv_exact(sock, n))
    if not isinstance(header, dict):
        raise ConnectionError("a header that is not an object")
    size = header.get("payload", 0)
    if not isinstance(size, int) or not 0 <= size < max_payload:
        raise ConnectionError("bad payload size")
    return header, _recv_exact(sock, size) if size else b""


# -- the handshake (see the top of this file) ------------------------------------

def client_handshake(sock: socket.socket, secret: bytes) -> None:
    """Prove to the service that this process holds the secret, and check that
    the service holds it too; trust.AuthError otherwise."""
    from . import trust

    client_nonce = trust.new_nonce()
    send(sock, {"op": "hello", "nonce": client_nonce})
    reply, _ = recv(sock)
    if reply.get("status") != "challenge":
        raise trust.AuthError(reply.get("error") or "the compile service did not ask for the cache secret")
    server_nonce, nonce = trust.parse_nonce(reply.get("nonce")), bytes.fromhex(client_nonce)
    send(sock, {"op": "auth", "proof": trust.client_proof(secret, server_nonce, nonce)})
    reply, _ = recv(sock)
    if reply.get("status") != "ok":
        raise trust.AuthError(reply.get("error") or "the compile service refused this process")
    if not trust.proof_matches(reply.get("proof"), trust.server_proof(secret, server_nonce, nonce)):
        raise trust.AuthError("the compile service did not prove that it holds the cache secret")


UNAUTHORIZED = ("this compile service requires clients to prove they hold its cache secret "
                "(set the same TORCHNEURON_CACHE_SECRET or TORCHNEURON_CACHE_SECRET_FILE in clients)")


def server_handshake(sock: socket.socket, secret: bytes) -> bool:
    """Whether the peer proved it holds the secret; if not, it has been told why."""
    from . import trust

    header, _ = recv(sock, _MAX_UNAUTHENTICATED)
    if header.get("op") != "hello":
        send(sock, {"status": "unauthorized", "error": UNAUTHORIZED})
        return False
    try:
        client_nonce = trust.parse_nonce(header.get("nonce"))
    except trust.AuthError as e:
        send(sock, {"status": "unauthorized", "error": str(e)})
        return False
    nonce = trust.new_nonce()
    send(sock, {"status": "challenge", "nonce": nonce})
    header, _ = recv(sock, _MAX_UNAUTHENTICATED)
    server_nonce = bytes.fromhex(nonce)
    if header.get("op") != "auth" or not trust.proof_matches(
            header.get("proof"), trust.client_proof(secret, server_nonce, client_nonce)):
        send(sock, {"status": "unauthorized",
                    "error": "the client did not prove that it holds this compile service's cache secret"})
        return False
    send(sock, {"status": "ok", "proof": trust.server_proof(secret, server_nonce, client_nonce)})
    return True
