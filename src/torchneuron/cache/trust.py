"""Who may hand this process native code.

An executable is code this process runs. The checksum in an entry proves it
arrived intact, not who wrote it: anyone who can write to the Redis store, the
job's c10d store or talk to a compile service could otherwise make every
worker run their code. With a shared secret (TORCHNEURON_CACHE_SECRET or
TORCHNEURON_CACHE_SECRET_FILE) every entry from a shared layer carries an
HMAC-SHA256 made with it, checked before the executable is loaded, and the
compile service and its clients prove to each other that they hold it.

Every MAC names its purpose first, so a value made for one use (an entry, a
client's proof, a server's proof) is never accepted for another.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import os
import secrets
import socket
import stat
import threading
import warnings

from .. import config

_MIN_SECRET_BYTES = 16
_NONCE_BYTES = 32
_ENTRY = b"torchneuron entry v1"
_CLIENT_PROOF = b"torchneuron service client v1"
_SERVER_PROOF = b"torchneuron service server v1"

_GENERATE = "python -c 'import secrets; print(secrets.token_hex(32))'"


class SecretError(ValueError):
    """The secret is configured in a way that cannot be used safely."""


class AuthError(ConnectionError):
    """A peer did not prove that it holds the secret (or refused us)."""


# -- the secret ---------------------------------------------------------------

_cached: tuple = (None, None)  # ((secret setting, file setting), secret bytes)
_lock = threading.Lock()


def secret() -> bytes | None:
    """The shared secret, or None when none is configured. Raises SecretError
    for a key file others can read, a missing file, both settings at once or
    a secret too short to resist guessing."""
    global _cached
    source = (config.settings.cache_secret, config.settings.cache_secret_file)
    if _cached[0] == source:
        return _cached[1]
    with _lock:
        value = _read(*source)
        _cached = (source, value)
    return value


def _read(inline: str, path: str) -> bytes | None:
    if inline and path:
        raise SecretError("set TORCHNEURON_CACHE_SECRET or TORCHNEURON_CACHE_SECRET_FILE, not both")
    if path:
        value = _read_key_file(os.path.expanduser(path))
        where = f"the key file {path}"
    elif inline:
        value = inline.encode()
        where = "TORCHNEURON_CACHE_SECRET"
    else:
        return None
    if len(value) < _MIN_SECRET_BYTES:
        raise SecretError(f"{where} holds {len(value)} bytes; a cache secret needs at least "
                          f"{_MIN_SECRET_BYTES} (make one with {_GENERATE})")
    return value


def _read_key_file(path: str) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise SecretError(f"cannot read TORCHNEURON_CACHE_SECRET_FILE {path}: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(f.fileno()).st_mode
        # As ssh does for private keys: a key others can read is no secret.
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise SecretError(f"TORCHNEURON_CACHE_SECRET_FILE {path} is accessible by group or others "
                              f"(mode {stat.S_IMODE(mode):04o}); it is refused: run `chmod 600 {path}`")
        return f.read().strip()


# -- entries --------------------------------------------------------------------

def _mac(key: bytes, purpose: bytes, *parts: bytes) -> str:
    mac = hmac.new(key, purpose, hashlib.sha256)
    for part in parts:  # length-prefixed: no two different part lists read the same
        mac.update(len(part).to_bytes(8, "big"))
        mac.update(part)
    return mac.hexdigest()


def _header_bytes(header: dict) -> bytes:
    return json.dumps({k: v for k, v in header.items() if k != "hmac"}, sort_keys=True,
                      separators=(",", ":")).encode()


def entry_mac(key: bytes, header: dict) -> str:
    """The MAC of an entry's header: its key, size and sha256 (which binds the
    executable's bytes) and every other field, all but "hmac" itself."""
    return _mac(key, _ENTRY, _header_bytes(header))


def entry_is_signed(key: bytes, header: dict) -> bool:
    given = header.get("hmac")
    return isinstance(given, str) and hmac.compare_digest(given, entry_mac(key, header))


# -- the compile service's handshake --------------------------------------------

def new_nonce() -> str:
    return secrets.token_hex(_NONCE_BYTES)


def parse_nonce(value) -> bytes:
    """A peer's nonce, as bytes; AuthError for anything but 32 random bytes in hex."""
    try:
        raw = bytes.fromhex(value)
    except (TypeError, ValueError):
        raise AuthError("a malformed handshake nonce") from None
    if len(raw) != _NONCE_BYTES:
        raise AuthError("a malformed handshake nonce")
    return raw


def client_proof(key: bytes, server_nonce: bytes, client_nonce: bytes) -> str:
    return _mac(key, _CLIENT_PROOF, server_nonce, client_nonce)


def server_proof(key: bytes, server_nonce: bytes, client_nonce: bytes) -> str:
    return _mac(key, _SERVER_PROOF, server_nonce, client_nonce)


def proof_matches(given, expected: str) -> bool:
    return isinstance(given, str) and hmac.compare_digest(given, expected)


def is_loopback(host: str) -> bool:
    """Whether every address the host names is a loopback address."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


# -- refusals and warnings --------------------------------------------------------

refused = {"remote": 0, "service": 0, "peer": 0}  # entries refused, by the layer they came from
_warned: set = set()


def _warn_once(topic: str, message: str) -> None:
    with _lock:
        if topic in _warned:
            return
        _warned.add(topic)
    warnings.warn(message, RuntimeWarning, stacklevel=4)


def refuse(layer: str, where: str) -> None:
    """Count an entry without a valid MAC from a layer; warn the first time."""
    with _lock:
        refused[layer] += 1
    _warn_once(f"refused-{layer}", f"neuron: refused an executable from {where}: it is not signed with this "
               "process's TORCHNEURON_CACHE_SECRET (written without the secret, with another one, or changed "
               f"after signing); compiling locally. Refusals are counted in compile_stats()['{layer}_untrusted'].")


def warn_unsigned_remote(url: str) -> None:
    _warn_once("unsigned-remote", f"neuron: the remote executable cache {url} is trusted by checksum only: anyone "
               "who can write to it can run code in this process. Set TORCHNEURON_CACHE_SECRET (or "
               "TORCHNEURON_CACHE_SECRET_FILE) to the same secret on every host to sign and check its entries.")
