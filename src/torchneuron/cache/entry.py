"""One executable as a single self-checking blob, for stores that hold values
rather than files (Redis, the c10d store, the compile service's replies):

    b"TNX1" | u32 header length | JSON header (key, size, sha256, ...) | vmfb

Nothing here is pickled: a blob from any store is data, checked before use.
The checksum proves the bytes arrived intact; with a cache secret configured
the header also carries "hmac" (see trust.py), which proves they were written
by someone holding the secret, and an entry without a valid one is refused.
"""

from __future__ import annotations

import hashlib
import json
import struct

from . import trust

MAGIC = b"TNX1"


class CorruptEntry(ValueError):
    pass


class UntrustedEntry(CorruptEntry):
    """Intact, but not signed with this process's secret: never loaded."""


def pack(key: str, vmfb: bytes, **meta) -> bytes:
    header = dict(meta, key=key, size=len(vmfb), sha256=hashlib.sha256(vmfb).hexdigest())
    header.pop("hmac", None)
    secret = trust.secret()
    if secret is not None:
        header["hmac"] = trust.entry_mac(secret, header)
    raw = json.dumps(header, sort_keys=True).encode()
    return MAGIC + struct.pack(">I", len(raw)) + raw + vmfb


def unpack(blob: bytes, key: str) -> tuple:
    """(vmfb, header) after checking the magic, the key, the size and the
    checksum, and with a secret configured, the header's MAC."""
    if len(blob) < 8 or blob[:4] != MAGIC:
        raise CorruptEntry("not an executable entry")
    (n,) = struct.unpack(">I", blob[4:8])
    try:
        header = json.loads(blob[8 : 8 + n])
    except ValueError as e:
        raise CorruptEntry(f"unreadable header: {e}") from None
    vmfb = blob[8 + n :]
    if not isinstance(header, dict) or header.get("key") != key:
        raise CorruptEntry("entry is for another key")
    if header.get("size") != len(vmfb) or header.get("sha256") != hashlib.sha256(vmfb).hexdigest():
        raise CorruptEntry("checksum mismatch")
    secret = trust.secret()
    if secret is not None and not trust.entry_is_signed(secret, header):
        raise UntrustedEntry("not signed with this process's cache secret")
    return vmfb, header
