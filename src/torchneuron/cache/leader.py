"""Leader-compiles inside one torch.distributed job, with no server at all.

Ranks meet in the job's c10d store: the first rank to claim a key compiles it
and publishes the executable; the others wait (with a timeout) and fetch it.
A rank that times out compiles the key itself, so a dead leader costs time,
never the job. With a cache secret, the leader's entry is signed and a rank
refuses (and compiles itself) an entry without a valid signature: anyone who
can reach the job's store could otherwise hand every rank code to run.
"""

from __future__ import annotations

import datetime
import json

from .. import config
from . import entry, trust

_ERROR = b"TNXE"  # the leader's compiler said no: waiters raise the same error


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
        store.set(value_key, entry.pack(key, vmfb))
        stats.led += 1
        return vmfb, seconds, source
    try:
        store.wait([value_key], datetime.timedelta(seconds=config.settings.leader_timeout))
        blob = bytes(store.get(value_key))
    except Exception:  # noqa: BLE001 - a timeout or a store failure: compile here
        stats.timeouts += 1
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
