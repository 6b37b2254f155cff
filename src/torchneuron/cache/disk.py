"""The persistent executable cache: a private directory of content-addressed
entries shared by every process of this user on this host.

    ROOT/exe/ab/KEY.vmfb     the executable
    ROOT/exe/ab/KEY.json     its metadata: checksum, size, key components, times
    ROOT/plan/ab/ID.json     an op signature's lowering result (which executable,
                             result shapes), so a restart lowers nothing
    ROOT/locks/NAME.lock     cross-process locks: one compile per key per host
    ROOT/warm/ID.json        records (read_record/write_record): a program's plan
                             ids, preloaded at its next start (dispatch/warm_start.py)
    ROOT/target/ID.json      ... and a CPU description resolved to the compiler's
                             name and features (compiler/target_cpu.py, `TargetStore`)

Writes go to a temporary name and are renamed into place; the metadata is
written last, so an entry exists only once it is complete, and readers never
open temporaries. Every read is checked against the checksum; a bad entry is
deleted, counted and treated as a miss. Locks are flock()s: the kernel drops
them when their holder dies, and waiters give up after a timeout.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import threading
import time
import warnings

from .. import config
from . import target_check

_TMP = ".tmp-"


class CacheDirectoryError(RuntimeError):
    """The cache directory is not safe to load code from."""


def _checksum(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _json_bytes(record: dict) -> bytes:
    return json.dumps(record, sort_keys=True, separators=(",", ":")).encode()


class DiskCache:
    def __init__(self, root: str, max_bytes: int, allow_shared: bool = False):
        self.root = os.path.abspath(os.path.expanduser(root))
        self.max_bytes = max_bytes
        self.enabled = True  # reads possible
        self.writable = True
        self.hits = 0
        self.misses = 0
        self.writes = 0
        self.corrupt = 0
        self.wrong_target = 0  # entries compiled for another target, deleted
        self.evictions = 0
        self.plan_hits = 0
        self.write_errors = 0
        self._bytes: int | None = None  # estimate of exe bytes, scanned lazily
        self._lock = threading.Lock()
        self._warned: set = set()
        self._open(allow_shared)

    # -- opening and safety ------------------------------------------------

    def _open(self, allow_shared: bool) -> None:
        try:
            os.makedirs(self.root, mode=0o700, exist_ok=True)
        except OSError as e:
            self.enabled = self.writable = False
            self._warn_once("open", f"neuron: cannot create the executable cache {self.root} ({e}); "
                                    "executables are compiled in every process")
            return
        st = os.stat(self.root)
        foreign = st.st_uid != os.getuid()
        open_to_others = bool(st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))
        if (foreign or open_to_others) and not allow_shared:
            who = "owned by another user" if foreign else f"writable by other users (mode {oct(st.st_mode & 0o777)})"
            raise CacheDirectoryError(
                f"neuron: refusing the executable cache {self.root}: it is {who}, and it holds code this "
                f"process would run. Use a private directory (chmod 700 it, or set TORCHNEURON_CACHE_DIR), "
                f"or set TORCHNEURON_CACHE_ALLOW_SHARED=1 if every user who can write it is trusted."
            )
        if not os.access(self.root, os.W_OK):
            self._read_only(PermissionError(f"{self.root} is read-only"))
            return
        for kind in ("exe", "plan", "locks"):
            with contextlib.suppress(OSError):
                os.makedirs(os.path.join(self.root, kind), mode=0o700, exist_ok=True)

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def _read_only(self, error: OSError) -> None:
        self.writable = False
        self.write_errors += 1
        self._warn_once("write", f"neuron: cannot write the executable cache {self.root} ({error}); "
                                 "running on, without saving new executables")

    # -- paths ------------------------------------------------------------

    def _path(self, kind: str, name: str, suffix: str) -> str:
        return os.path.join(self.root, kind, name[:2], name + suffix)

    def _write_atomic(self, path: str, data: bytes) -> None:
        directory = os.path.dirname(path)
        os.makedirs(directory, mode=0o700, exist_ok=True)
        tmp = os.path.join(directory, f"{_TMP}{os.getpid()}-{threading.get_ident()}-{os.path.basename(path)}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def _discard(self, kind: str, name: str, why: str) -> None:
        self.corrupt += 1
        self._warn_once("corrupt", f"neuron: a corrupt entry in the executable cache was deleted and will be "
                                   f"rebuilt ({kind} {name[:16]}: {why})")
        for suffix in (".vmfb", ".json"):
            with contextlib.suppress(OSError):
                os.unlink(self._path(kind, name, suffix))

    # -- executables --------------------------------------------------------

    def discard_executable(self, key: str, why: str) -> None:
        """Delete an entry that was not compiled for the target of its key
        (cache/target_check.py), saying so once."""
        self.wrong_target += 1
        self._warn_once("wrong_target", f"neuron: an executable cache entry compiled for another target was "
                                        f"deleted and will be rebuilt ({key[:16]}: {why})")
        for suffix in (".vmfb", ".json"):
            with contextlib.suppress(OSError):
                os.unlink(self._path("exe", key, suffix))

    def get_executable(self, key: str, target: tuple | None = None) -> bytes | None:
        """The executable stored under `key`, if it is intact and compiled for
        `target` (backend, flags; default: the configured one)."""
        vmfb = self._read_executable(key)
        if vmfb is None:
            return None
        if target is None:
            from ..compiler import target_flags, target_known

            if not target_known():
                return vmfb  # never wait here for the CPU to be resolved (ranks wait on each other)
            target = target_flags()
        why = target_check.mismatch(vmfb, *target)
        if why is not None:
            self.hits -= 1
            self.misses += 1
            self.discard_executable(key, why)
            return None
        return vmfb

    def _read_executable(self, key: str) -> bytes | None:
        if not self.enabled:
            return None
        meta_path = self._path("exe", key, ".json")
        try:
            with open(meta_path, "rb") as f:
                meta = json.loads(f.read())
            with open(self._path("exe", key, ".vmfb"), "rb") as f:
                vmfb = f.read()
        except FileNotFoundError:
            self.misses += 1
            return None
        except (OSError, ValueError) as e:
            self._discard("exe", key, str(e))
            self.misses += 1
            return None
        if not isinstance(meta, dict) or meta.get("size") != len(vmfb) or meta.get("sha256") != _checksum(vmfb):
            self._discard("exe", key, "checksum mismatch")
            self.misses += 1
            return None
        with contextlib.suppress(OSError):
            os.utime(meta_path)  # last used, for LRU eviction
        self.hits += 1
        return vmfb

    def has_executable(self, key: str) -> bool:
        return self.enabled and os.path.exists(self._path("exe", key, ".json"))

    def put_executable(self, key: str, vmfb: bytes, meta: dict | None = None) -> None:
        if not self.writable:
            return
        record = dict(meta or {})
        record.update(key=key, size=len(vmfb), sha256=_checksum(vmfb), created=time.time())
        try:
            self._write_atomic(self._path("exe", key, ".vmfb"), vmfb)
            self._write_atomic(self._path("exe", key, ".json"), _json_bytes(record))
        except OSError as e:
            self._read_only(e)
            return
        self.writes += 1
        with self._lock:
            if self._bytes is None:
                self._bytes = self.total_bytes()
            else:
                self._bytes += len(vmfb)
            over = self._bytes > self.max_bytes
        if over:
            self.prune(int(self.max_bytes * 0.9))

    def read_meta(self, key: str) -> dict | None:
        try:
            with open(self._path("exe", key, ".json"), "rb") as f:
                return json.loads(f.read())
        except (OSError, ValueError):
            return None

    # -- plans ------------------------------------------------------------

    def get_plan(self, plan_id: str) -> dict | None:
        if not self.enabled:
            return None
        try:
            with open(self._path("plan", plan_id, ".json"), "rb") as f:
                stored = json.loads(f.read())
            record = stored["record"]
            if stored["sha256"] != _checksum(_json_bytes(record)):
                raise ValueError("checksum mismatch")
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            self._discard("plan", plan_id, str(e))
            return None
        self.plan_hits += 1
        return record

    def put_plan(self, plan_id: str, record: dict) -> None:
        if not self.writable:
            return
        stored = {"record": record, "sha256": _checksum(_json_bytes(record))}
        try:
            self._write_atomic(self._path("plan", plan_id, ".json"), _json_bytes(stored))
        except OSError as e:
            self._read_only(e)

    # -- small records of other layers (warm/, target/) ---------------------

    def read_record(self, folder: str, name: str) -> bytes | None:
        """A record's bytes; None where there is none (its reader checks it)."""
        if not self.enabled:
            return None
        try:
            with open(os.path.join(self.root, folder, name + ".json"), "rb") as f:
                return f.read()
        except OSError:
            return None

    def write_record(self, folder: str, name: str, data: bytes) -> None:
        """Write a record whole (atomically). Records only save work, so a
        failed write is dropped: it leaves the executables writable."""
        if self.writable:
            with contextlib.suppress(OSError):
                self._write_atomic(os.path.join(self.root, folder, name + ".json"), data)

    # -- cross-process locks ---------------------------------------------

    @contextlib.contextmanager
    def lock(self, name: str, timeout: float | None = None):
        """Hold the host-wide lock `name`; yields False when it could not be
        taken (timeout, unwritable directory): the caller goes on without it."""
        import filelock

        timeout = config.settings.cache_lock_timeout if timeout is None else timeout
        if not self.writable:
            yield False
            return
        try:
            os.makedirs(os.path.join(self.root, "locks"), mode=0o700, exist_ok=True)
            lock = filelock.FileLock(os.path.join(self.root, "locks", name + ".lock"), timeout=timeout)
            lock.acquire()
        except filelock.Timeout:
            self._warn_once("lock", f"neuron: waited {timeout:g} s for another process compiling the same "
                                    "executable; compiling it here too")
            yield False
            return
        except OSError as e:
            self._read_only(e)
            yield False
            return
        try:
            yield True
        finally:
            lock.release()

    # -- maintenance (CLI) --------------------------------------------------

    def entries(self) -> list:
        """[(key, meta or None, vmfb bytes, last used)] for every executable."""
        out = []
        base = os.path.join(self.root, "exe")
        for sub in _scandir(base):
            for entry in _scandir(sub.path):
                name = entry.name
                if name.startswith(_TMP) or not name.endswith(".vmfb"):
                    continue
                key = name[: -len(".vmfb")]
                meta_path = os.path.join(sub.path, key + ".json")
                try:
                    used = os.stat(meta_path).st_mtime
                except OSError:
                    used = entry.stat().st_mtime
                out.append((key, self.read_meta(key), entry.stat().st_size, used))
        return out

    def total_bytes(self) -> int:
        return sum(size for _, _, size, _ in self.entries())

    def plan_count(self) -> int:
        return sum(1 for sub in _scandir(os.path.join(self.root, "plan")) for _ in _scandir(sub.path))

    def prune(self, max_bytes: int | None = None) -> int:
        """Evict least recently used executables until under max_bytes, and
        remove stale temporaries; returns the number of entries evicted."""
        max_bytes = self.max_bytes if max_bytes is None else max_bytes
        entries = sorted(self.entries(), key=lambda e: e[3])
        total = sum(e[2] for e in entries)
        evicted = 0
        for key, _, size, _ in entries:
            if total <= max_bytes:
                break
            for suffix in (".json", ".vmfb"):  # metadata first: the entry vanishes atomically
                with contextlib.suppress(OSError):
                    os.unlink(self._path("exe", key, suffix))
            total -= size
            evicted += 1
        self._remove_stale_temporaries()
        with self._lock:
            self._bytes = total
            self.evictions += evicted
        return evicted

    def _remove_stale_temporaries(self, age: float = 3600.0) -> None:
        now = time.time()
        for kind in ("exe", "plan"):
            for sub in _scandir(os.path.join(self.root, kind)):
                for entry in _scandir(sub.path):
                    if entry.name.startswith(_TMP):
                        with contextlib.suppress(OSError):
                            if now - entry.stat().st_mtime > age:
                                os.unlink(entry.path)

    def verify(self) -> tuple:
        """Check every entry against its checksum; delete bad and incomplete
        ones. Returns (good, bad)."""
        good = bad = 0
        for key, _, _, _ in self.entries():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ok = self.get_executable(key) is not None
            if ok:
                good += 1
            else:
                bad += 1
                for suffix in (".json", ".vmfb"):
                    with contextlib.suppress(OSError):
                        os.unlink(self._path("exe", key, suffix))
        return good, bad

    def clear(self) -> int:
        import shutil

        n = len(self.entries())
        for kind in ("exe", "plan", "locks"):
            shutil.rmtree(os.path.join(self.root, kind), ignore_errors=True)
        with self._lock:
            self._bytes = 0
        return n

    def stats(self) -> dict:
        return {
            "disk_hits": self.hits,
            "disk_misses": self.misses,
            "disk_writes": self.writes,
            "disk_corrupt": self.corrupt,
            "disk_wrong_target": self.wrong_target,
            "disk_evictions": self.evictions,
            "plan_disk_hits": self.plan_hits,
        }


def _scandir(path: str):
    try:
        with os.scandir(path) as it:
            return [e for e in it]
    except OSError:
        return []


_disk: DiskCache | None = None
_disk_config: tuple | None = None
_disk_lock = threading.Lock()


def disk_cache() -> DiskCache | None:
    """The disk cache of the current settings, or None when it is off."""
    global _disk, _disk_config
    s = config.settings
    wanted = (s.cache_dir, s.cache_size_mb, s.cache_allow_shared)
    if wanted == _disk_config:
        return _disk
    with _disk_lock:
        if wanted != _disk_config:
            if not s.cache_dir or s.cache_dir.lower() == "off":
                _disk = None
            else:
                _disk = DiskCache(s.cache_dir, s.cache_size_mb * 1024 * 1024, s.cache_allow_shared)
            _disk_config = wanted
    return _disk


class TargetStore:
    """Where the compiler keeps resolved CPUs (compiler/target_cpu.py's
    `store`): the folder target/ of the current disk cache, if any."""

    @staticmethod
    def _disk():
        try:
            return disk_cache()
        except Exception:  # noqa: BLE001 - an unusable cache directory is reported by the first op
            return None

    def read(self, name: str) -> bytes | None:
        disk = self._disk()
        return disk.read_record("target", name) if disk is not None else None

    def write(self, name: str, data: bytes) -> None:
        disk = self._disk()
        if disk is not None:
            disk.write_record("target", name, data)
