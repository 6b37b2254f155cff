"""Leader-compiles inside one torch.distributed job, with no server at all.

Ranks meet in the job's c10d store: the first rank to claim a key compiles it
and publishes the executable; the others wait (with a timeout) and fetch it.
A rank that times out compiles the key itself, so a dead leader costs time,
never the job. A leader whose compile fails for any other reason than the
compiler's verdict says so (the others compile the key themselves rather
than wait out the timeout), and a rank whose interpreter is exiting stops
waiting: a background compile left over at exit once held a rank's exit
for the whole timeout. With a cache secret, the leader's entry is signed and a rank
refuses (and compiles itself) an entry without a valid signature: anyone who
can reach the job's store could otherwise hand every rank code to run.
"""

from __future__ import annotations

import datetime
import json
import threading
import time

from .. import config
from . import entry, trust

_ERROR = b"TNXE"  # the leader's compiler said no: waiters raise the same error
_GAVE_UP = b"TNXG"  # the leader's compile broke otherwise: waiters compile the key themselves
_exiting = threading.Event()
threading._register_atexit(_exiting.set)  # before the interpreter joins the compile threads


def active() -> bool:
    if not config.settings.leader_compile:
        return False
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _store():
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


class LeaderStats:
    led = 0  # keys this rank compiled for the job
    fetched = 0  # keys another rank compiled
    timeouts = 0


stats = LeaderStats()


def compile_or_fetch(key: str, compile_fn) -> tuple:
    """(vmfb, seconds, source): compile_fn() -> (vmfb, seconds, source) runs on
    the leader; the other ranks get the leader's executable (source "peer")."""
    from ..compiler import CompileError

    store = _store()
    value_key = f"torchneuron/exe/{key}"
    if store.add(f"torchneuron/claim/{key}", 1) == 1:
        try:
            vmfb, seconds, source = compile_fn()
        except CompileError as e:
            store.set(value_key, _ERROR + json.dumps({"what": e.what, "diagnostic": e.diagnostic}).encode())
            raise
        except BaseException:
            store.set(value_key, _GAVE_UP)
            raise
        store.set(value_key, entry.pack(key, vmfb))
        stats.led += 1
        return vmfb, seconds, source
    try:
        blob = _wait(store, value_key)
    except Exception:  # noqa: BLE001 - a timeout, a store failure or exit: compile here
        stats.timeouts += 1
        return compile_fn()
    if blob.startswith(_GAVE_UP):
        return compile_fn()
    if blob.startswith(_ERROR):
        err = json.loads(blob[len(_ERROR):])
        raise CompileError(err["what"], err["diagnostic"])
    try:
        vmfb, _ = entry.unpack(blob, key)
    except entry.CorruptEntry as e:
        if isinstance(e, entry.UntrustedEntry):
            trust.refuse("peer", "another rank through the job's store")
        return compile_fn()
    stats.fetched += 1
    return vmfb, 0.0, "peer"


def _wait(store, value_key: str) -> bytes:
    """The leader's blob, waiting for it up to the leader timeout in short
    slices, so that an exiting interpreter stops waiting."""
    deadline = time.monotonic() + config.settings.leader_timeout
    while True:
        left = deadline - time.monotonic()
        if _exiting.is_set() or left <= 0:
            raise TimeoutError(f"no executable from the leader for {value_key}")
        try:
            store.wait([value_key], datetime.timedelta(seconds=min(left, 1.0)))
        except Exception:  # noqa: BLE001 - c10d raises a plain error on a timeout: is the key there?
            if not store.check([value_key]):
                continue
        return bytes(store.get(value_key))
