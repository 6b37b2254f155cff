"""`torchneuron cache ...`: look inside the persistent cache and manage it.

An exported archive carries executables to other machines, so with a cache
secret each executable's and plan's record is signed (the same HMAC as a
shared entry, see trust.py), and an import with a secret takes only members
signed with it: an archive is a shared layer like any other.
"""

from __future__ import annotations

import io
import json
import os
import re
import sys
import tarfile
import time

from . import trust
from .disk import DiskCache, disk_cache

_EXE_NAME = re.compile(r"^exe/[0-9a-f]{2}/([0-9a-f]{64})\.(vmfb|json)$")
_PLAN_NAME = re.compile(r"^plan/[0-9a-f]{2}/([0-9a-f]{64})\.json$")


def _out(args, data, text: str) -> None:
    print(json.dumps(data, indent=2, default=str) if args.json else text)


def _short(text: str, n: int = 100) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def _resolve(disk: DiskCache, prefix: str) -> str:
    matches = [k for k, _, _, _ in disk.entries() if k.startswith(prefix)]
    if len(matches) != 1:
        raise SystemExit(f"torchneuron cache: {len(matches)} entries match {prefix!r}")
    return matches[0]


def run(args) -> int:
    disk = disk_cache()
    if disk is None:
        print("the persistent cache is off (TORCHNEURON_CACHE_DIR is empty or 'off')", file=sys.stderr)
        return 1
    action = args.action
    if action == "stats":
        entries = disk.entries()
        data = {
            "directory": disk.root,
            "executables": len(entries),
            "bytes": sum(e[2] for e in entries),
            "cap_bytes": disk.max_bytes,
            "plans": disk.plan_count(),
            "writable": disk.writable,
            "compile_seconds_saved_per_reuse": round(sum((e[1] or {}).get("compile_seconds", 0) for e in entries), 1),
        }
        _out(args, data, "\n".join(f"{k:32s} {v}" for k, v in data.items()))
    elif action == "list":
        entries = sorted(disk.entries(), key=lambda e: -e[3])[: args.limit]
        rows = [{"key": k, "bytes": size, "last_used": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(used)),
                 "compile_seconds": (m or {}).get("compile_seconds"), "what": (m or {}).get("what", "?")}
                for k, m, size, used in entries]
        _out(args, rows, "\n".join(f"{r['key'][:16]}  {r['bytes']:>9d} B  {r['last_used']}  "
                                   f"{r['compile_seconds'] or 0:6.2f} s  {_short(r['what'])}" for r in rows))
    elif action == "clear":
        n = disk.clear()
        _out(args, {"deleted": n}, f"deleted {n} executables and every plan from {disk.root}")
    elif action == "prune":
        target = int(args.max_mb * 1024 * 1024) if args.max_mb is not None else disk.max_bytes
        n = disk.prune(target)
        _out(args, {"evicted": n, "bytes": disk.total_bytes()}, f"evicted {n} executables; {disk.total_bytes()} bytes left")
    elif action == "verify":
        good, bad = disk.verify()
        _out(args, {"good": good, "bad": bad}, f"{good} entries verified, {bad} bad entries deleted")
        return 1 if bad else 0
    elif action == "explain":
        return _explain(args, disk)
    elif action == "export":
        n = export(disk, args.file)
        _out(args, {"exported": n}, f"exported {n} files to {args.file}")
    elif action == "import":
        exes, plans, rejected, untrusted = import_(disk, args.file)
        _out(args, {"executables": exes, "plans": plans, "rejected": rejected, "untrusted": untrusted},
             f"imported {exes} executables and {plans} plans; rejected {rejected} bad members"
             + (f" ({untrusted} not signed with this cache secret)" if untrusted else ""))
        return 1 if rejected else 0
    return 0


def _explain(args, disk: DiskCache) -> int:
    keys = [_resolve(disk, k) for k in args.keys]
    comps = []
    for key in keys:
        meta = disk.read_meta(key) or {}
        comps.append(dict(meta.get("components") or {}, op=meta.get("what")))
        if not args.diff:
            data = {"key": key, "what": meta.get("what"), "components": {k: v for k, v in comps[-1].items() if k != "op"},
                    "compile_seconds": meta.get("compile_seconds"), "bytes": meta.get("size")}
            shown = dict(data["components"])
            if isinstance(shown.get("flags"), list):
                shown["flags"] = [_short_flag(f) for f in shown["flags"]]
            _out(args, data, "\n".join(f"{k:16s} {v}" for k, v in data.items() if k != "components")
                 + "\n" + "\n".join(f"  {k:20s} {v}" for k, v in shown.items()))
    if args.diff:
        if len(keys) != 2:
            raise SystemExit("torchneuron cache explain --diff takes two keys")
        diff = diff_components(*comps)
        _out(args, diff, "the keys do not differ in any recorded component" if not diff else
             "\n".join(_diff_text(k, d) for k, d in diff.items()))
    return 0


def _add_json(tar: tarfile.TarFile, name: str, record: dict) -> None:
    data = json.dumps(record, sort_keys=True).encode()
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), int(time.time()), 0o600
    tar.addfile(info, io.BytesIO(data))


def _signed(record: dict, secret: bytes | None) -> dict:
    return record if secret is None else dict(record, hmac=trust.entry_mac(secret, record))


def diff_components(a: dict, b: dict) -> dict:
    """{component: [A's, B's]} for each that differs; the CPU's feature list
    and the flags as what only one side has (each is hundreds of characters)."""
    from ..compiler.target_cpu import enabled_features

    diff = {}
    # The CPU first: when it differs, it is the reason that matters.
    for k in sorted(set(a) | set(b), key=lambda k: (not k.startswith("target_cpu"), k)):
        va, vb = a.get(k), b.get(k)
        if va == vb:
            continue
        if k == "target_cpu_features" and isinstance(va, str) and isinstance(vb, str):
            fa, fb = enabled_features(va), enabled_features(vb)
            diff[k] = {"only_in_a": sorted(fa - fb), "only_in_b": sorted(fb - fa)} if fa != fb else [va, vb]
        elif k == "flags" and isinstance(va, list) and isinstance(vb, list):
            diff[k] = {"only_in_a": [_short_flag(f) for f in va if f not in vb],
                       "only_in_b": [_short_flag(f) for f in vb if f not in va]}
        else:
            diff[k] = [va, vb]
    return diff


def _short_flag(flag: str) -> str:
    # The CPU's feature list would bury the other flags: it has its own component.
    from ..compiler.target_cpu import FEATURES_FLAG

    return FEATURES_FLAG + "... (see target_cpu_features)" if flag.startswith(FEATURES_FLAG) else flag


def _diff_text(name: str, d) -> str:
    if isinstance(d, dict):
        what = "features enabled" if name == "target_cpu_features" else "flags"
        return (f"{name}:\n  {what} only in A: {', '.join(d['only_in_a']) or '-'}"
                f"\n  {what} only in B: {', '.join(d['only_in_b']) or '-'}")
    return f"{name}:\n  A: {d[0]}\n  B: {d[1]}"


def export(disk: DiskCache, path: str) -> int:
    """Every complete entry and plan into a .tar.gz (each record signed when a
    cache secret is configured); returns files written."""
    secret = trust.secret()
    n = 0
    with tarfile.open(path, "w:gz") as tar:
        for key, meta, _, _ in disk.entries():
            if meta is None:
                continue
            tar.add(disk._path("exe", key, ".vmfb"), arcname=f"exe/{key[:2]}/{key}.vmfb")
            _add_json(tar, f"exe/{key[:2]}/{key}.json", _signed(meta, secret))
            n += 2
        base = os.path.join(disk.root, "plan")
        for sub in sorted(os.listdir(base)) if os.path.isdir(base) else []:
            for name in sorted(os.listdir(os.path.join(base, sub))):
                if not _PLAN_NAME.match(f"plan/{sub}/{name}"):
                    continue
                try:
                    with open(os.path.join(base, sub, name), "rb") as f:
                        stored = json.loads(f.read())
                except (OSError, ValueError):
                    continue  # being replaced, or corrupt: the reader rebuilds it anyway
                _add_json(tar, f"plan/{sub}/{name}", _signed(stored, secret))
                n += 1
    return n


def import_(disk: DiskCache, path: str) -> tuple:
    """Add an export's entries, each checked; nothing is extracted by name.
    With a cache secret, members not signed with it are rejected too.
    Returns (executables, plans, rejected members, of which unsigned)."""
    import hashlib

    from .key import key_of

    secret = trust.secret()
    exes: dict = {}
    plans = rejected = untrusted = 0
    with tarfile.open(path, "r:gz") as tar:
        for member in tar:
            if not member.isfile():
                rejected += 1
                continue
            data = tar.extractfile(member).read()
            m = _EXE_NAME.match(member.name)
            if m:
                exes.setdefault(m.group(1), {})[m.group(2)] = data
                continue
            m = _PLAN_NAME.match(member.name)
            if m:
                try:
                    stored = json.loads(data)
                    record = stored["record"]
                    check = hashlib.sha256(json.dumps(record, sort_keys=True, separators=(",", ":")).encode())
                    if stored["sha256"] != check.hexdigest():
                        raise ValueError
                except (ValueError, KeyError, TypeError):
                    rejected += 1
                    continue
                if secret is not None and not trust.entry_is_signed(secret, stored):
                    rejected += 1
                    untrusted += 1
                    continue
                disk.put_plan(m.group(1), record)
                plans += 1
                continue
            rejected += 1
    imported = 0
    for key, parts in exes.items():
        try:
            meta = json.loads(parts["json"])
            vmfb = parts["vmfb"]
            ok = meta.get("key") == key and meta.get("sha256") == hashlib.sha256(vmfb).hexdigest()
            # Its recorded components (compiler, flags, CPU) must be what its
            # key is the hash of: `explain` then tells the truth about it.
            ok = ok and isinstance(meta.get("components"), dict) and key_of(meta["components"]) == key
        except (KeyError, ValueError, AttributeError, TypeError):
            ok = False
        if not ok:
            rejected += 1
            continue
        if secret is not None and not trust.entry_is_signed(secret, meta):
            rejected += 1
            untrusted += 1
            continue
        meta = {k: v for k, v in meta.items() if k not in ("key", "size", "sha256", "created", "hmac")}
        disk.put_executable(key, vmfb, meta)
        imported += 1
    return imported, plans, rejected, untrusted


__all__ = ["export", "import_", "run"]
