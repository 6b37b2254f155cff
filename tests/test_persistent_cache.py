"""The persistent executable cache, its layers and its faults (issue: persistent
executable cache and a shared compile service).

Workloads run in fresh processes, as users run them: a restart, a corrupt
entry, a read-only directory or a full disk, eight processes at once.
"""

import json
import os
import pathlib
import signal
import stat
import subprocess
import sys
import tarfile
import textwrap
import time

import pytest
import torch

import torchneuron
from torchneuron.cache.disk import CacheDirectoryError, DiskCache

# A workload: a few ops checked against CPU; prints the compile statistics.
WORKLOAD = """
import json, sys, warnings
import torch, torchneuron
warnings.simplefilter("always")
torch.manual_seed(0)
x, w = torch.randn(16, 24), torch.randn(24, 8)
SCALE = float(sys.argv[1]) if len(sys.argv) > 1 else 2.0
expected = torch.softmax((x @ w) * SCALE, -1).sum(0)
got = torch.softmax((x.neuron() @ w.neuron()) * SCALE, -1).sum(0).cpu()
torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
s = torchneuron.compile_stats()
print("STATS " + json.dumps({"compiles": s["compiles"], "sources": s["sources"],
                             "corrupt": s.get("disk_corrupt", 0), "signatures": s["signatures"],
                             "remote_untrusted": s.get("remote_untrusted", 0)}))
"""


# Root writes anywhere: a workload that must meet a read-only directory runs as root without
# the capabilities that override file permissions (another user could not reach a checkout
# under a private directory).
WITHOUT_OVERRIDES = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner"]


def run_python(code: str, cache_dir, *args, env=None, without_overrides=False, timeout=240, check=True):
    """Run code in a fresh interpreter with the given cache directory; returns
    (parsed STATS line or None, stderr)."""
    full_env = dict(os.environ, TORCHNEURON_CACHE_DIR=str(cache_dir), TORCHNEURON_DEVICE_COUNT="1",
                    PYTHONDONTWRITEBYTECODE="1")
    full_env.update(env or {})
    cmd = [sys.executable, "-c", textwrap.dedent(code), *map(str, args)]
    if without_overrides and os.getuid() == 0:
        cmd = [*WITHOUT_OVERRIDES, *cmd]
    proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"workload failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}")
    stats = None
    for line in proc.stdout.splitlines():
        if line.startswith("STATS "):
            stats = json.loads(line[6:])
    return stats, proc.stderr


def exe_files(cache_dir):
    return sorted((cache_dir / "exe").glob("*/*.vmfb"))


# -- the disk cache -----------------------------------------------------------

@pytest.mark.op_mode  # per-op compiles, cache entries and launches
def test_restart_compiles_nothing_and_matches_cpu(tmp_path):
    first, _ = run_python(WORKLOAD, tmp_path)
    assert first["compiles"] == first["signatures"] >= 4
    second, _ = run_python(WORKLOAD, tmp_path)
    assert second["compiles"] == 0
    assert second["sources"]["disk"] == first["compiles"]
    # A scalar that changes across runs is a runtime input: still nothing to compile.
    third, _ = run_python(WORKLOAD, tmp_path, 0.5)
    assert third["compiles"] == 0


def test_new_cache_directory_is_private(tmp_path):
    root = tmp_path / "fresh" / "cache"
    DiskCache(str(root), 1 << 20)
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(root / "exe").st_mode) == 0o700


@pytest.mark.op_mode  # per-op compiles, cache entries and launches
def test_corrupt_and_truncated_entries_are_detected_rebuilt_and_warned(tmp_path):
    first, _ = run_python(WORKLOAD, tmp_path)
    files = exe_files(tmp_path)
    assert len(files) == first["compiles"]
    truncated, flipped = files[0], files[1]
    truncated.write_bytes(truncated.read_bytes()[:100])
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0xFF
    flipped.write_bytes(bytes(data))
    stats, err = run_python(WORKLOAD, tmp_path)
    # The warm-start thread and the first step may both meet a bad entry.
    assert stats["corrupt"] >= 2
    assert stats["compiles"] == 2  # exactly the two bad entries, rebuilt
    assert err.count("corrupt entry in the executable cache") == 1  # one warning
    assert truncated.stat().st_size > 100  # rewritten whole
    again, _ = run_python(WORKLOAD, tmp_path)
    assert again["compiles"] == 0 and again["corrupt"] == 0


@pytest.mark.op_mode  # per-op compiles, cache entries and launches
def test_corrupt_plan_record_is_rebuilt(tmp_path):
    run_python(WORKLOAD, tmp_path)
    for plan in (tmp_path / "plan").glob("*/*.json"):
        plan.write_text('{"record": {"kind": "plan", "executable": "0000"}, "sha256": "bad"}')
    stats, err = run_python(WORKLOAD, tmp_path)
    assert stats["compiles"] == 0  # executables were fine; only the plans were lowered again
    assert "corrupt entry" in err


@pytest.mark.op_mode  # per-op compiles, cache entries and launches
def test_disk_full_runs_on_and_warns_once(tmp_path):
    # The cache lives on a real, nearly full filesystem: a 256 KiB tmpfs in a
    # private mount namespace, filled to 250 KiB.
    cache = tmp_path / "full"
    cache.mkdir()
    script = tmp_path / "workload.py"
    script.write_text(WORKLOAD)
    userns = [] if os.getuid() == 0 else ["--map-root-user"]
    shell = (f"mount -t tmpfs -o size=256k,mode=0700 tmpfs {cache} && "
             f"head -c 256000 /dev/zero > {cache}/filler 2>/dev/null; exec {sys.executable} {script}")
    env = dict(os.environ, TORCHNEURON_CACHE_DIR=str(cache), TORCHNEURON_DEVICE_COUNT="1")
    proc = subprocess.run(["unshare", "--mount", *userns, "sh", "-c", shell], env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stats = json.loads(next(line[6:] for line in proc.stdout.splitlines() if line.startswith("STATS ")))
    assert stats["compiles"] >= 4  # every op ran compiled, and matched CPU
    assert proc.stderr.count("cannot write the executable cache") == 1
    assert "No space left on device" in proc.stderr


def test_read_only_cache_directory_runs_and_warns_once(tmp_path):
    base = tmp_path / "ro"
    cache = base / "cache"
    first, _ = run_python(WORKLOAD, cache)
    for dirpath, dirnames, filenames in os.walk(cache):
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o444)
        for name in dirnames:
            os.chmod(os.path.join(dirpath, name), 0o555)
    cache.chmod(0o555)
    try:
        # Cached ops load; a new one (another shape) compiles and is not saved.
        code = WORKLOAD + "\nprint((torch.ones(5).neuron() * 3).cpu().sum().item())"
        stats, err = run_python(code, cache, without_overrides=True, env={"HOME": str(base)})
        assert stats["compiles"] == 0 and stats["sources"]["disk"] == first["compiles"]
        assert err.count("cannot write the executable cache") == 1
    finally:
        for dirpath, dirnames, _ in os.walk(cache):
            for name in dirnames:
                os.chmod(os.path.join(dirpath, name), 0o755)
        cache.chmod(0o755)


@pytest.mark.op_mode  # per-op compiles, cache entries and launches
def test_eight_processes_one_key_compile_once(tmp_path):
    code = """
    import json, os, sys, time
    import torch, torchneuron
    x = torch.arange(37 * 3, dtype=torch.float32).reshape(37, 3)
    start = float(sys.argv[1])
    while time.time() < start:
        time.sleep(0.005)
    got = x.neuron().tanh().cpu()  # one signature, one key
    torch.testing.assert_close(got, x.tanh())
    s = torchneuron.compile_stats()
    print("STATS " + json.dumps({"compiles": s["compiles"], "sources": s["sources"]}))
    """
    env = dict(os.environ, TORCHNEURON_CACHE_DIR=str(tmp_path), TORCHNEURON_DEVICE_COUNT="1")
    start = time.time() + 20  # every process imported and waiting at once
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), str(start)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(8)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    stats = [json.loads(line[6:]) for out, _ in outs for line in out.splitlines() if line.startswith("STATS ")]
    assert len(stats) == 8
    assert sum(s["compiles"] for s in stats) == 1
    assert sum(s["sources"]["disk"] for s in stats) == 7
    assert len(exe_files(tmp_path)) == 1


def test_cache_directory_writable_by_others_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(CacheDirectoryError, match="writable by other users.*TORCHNEURON_CACHE_ALLOW_SHARED"):
        DiskCache(str(shared), 1 << 20)
    # The error reaches the user at their first op, and nothing runs silently.
    saved = torchneuron.config.settings.cache_dir
    torchneuron.config.set(cache_dir=str(shared))
    try:
        from torchneuron.dispatch import eager

        eager.reset()
        with pytest.raises(CacheDirectoryError):
            torch.ones(3, 7).neuron().exp().cpu()
        torchneuron.config.set(cache_allow_shared=True)
        torch.testing.assert_close(torch.ones(3, 7).neuron().exp().cpu(), torch.ones(3, 7).exp())
    finally:
        torchneuron.config.set(cache_dir=saved, cache_allow_shared=False)


def test_lru_eviction_under_the_size_cap_and_temporaries_ignored(tmp_path):
    disk = DiskCache(str(tmp_path), max_bytes=3000)
    blobs = {f"{i:064x}": bytes([i]) * 1000 for i in range(3)}
    for i, (key, blob) in enumerate(blobs.items()):
        disk.put_executable(key, blob)
        os.utime(disk._path("exe", key, ".json"), (1000 + i, 1000 + i))
    first = next(iter(blobs))
    assert disk.get_executable(first) == blobs[first]  # now the most recently used
    disk.put_executable(f"{9:064x}", b"x" * 1000)  # over the cap: evict the LRU
    assert disk.get_executable(f"{1:064x}") is None
    assert disk.get_executable(first) == blobs[first]
    assert disk.total_bytes() <= 3000
    # A writer's temporary is never read as an entry.
    tmp = tmp_path / "exe" / "ab" / (".tmp-1-2-" + "ab" * 32 + ".vmfb")
    tmp.parent.mkdir(exist_ok=True)
    tmp.write_bytes(b"half")
    assert all(not k.startswith(".tmp") for k, _, _, _ in disk.entries())
    assert disk.get_executable("ab" * 32) is None


def test_lock_of_a_crashed_holder_is_released(tmp_path):
    disk = DiskCache(str(tmp_path), 1 << 20)
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import filelock, sys, time
        lock = filelock.FileLock({str(tmp_path / "locks" / "exe-k.lock")!r})
        lock.acquire()
        print("held", flush=True)
        time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with pytest.warns(RuntimeWarning, match="waited 0.5 s for another process"):
        with disk.lock("exe-k", timeout=0.5) as got:
            assert got is False  # a live holder: we time out and go on without it
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    start = time.monotonic()
    with disk.lock("exe-k", timeout=30) as got:
        assert got is True
    assert time.monotonic() - start < 5


# -- the CLI ------------------------------------------------------------------

@pytest.mark.op_mode  # per-op compiles, cache entries and launches
def test_cache_cli_stats_list_explain_verify_export_import(tmp_path, capsys):
    from torchneuron import cli

    src = tmp_path / "src"
    run_python(WORKLOAD, src)
    saved = torchneuron.config.settings.cache_dir
    try:
        torchneuron.config.set(cache_dir=str(src))
        assert cli.main(["cache", "stats", "--json"]) == 0
        stats = json.loads(capsys.readouterr().out)
        assert stats["executables"] == len(exe_files(src)) >= 4 and stats["plans"] >= 4
        assert cli.main(["cache", "list", "--json"]) == 0
        rows = json.loads(capsys.readouterr().out)
        keys = [r["key"] for r in rows]
        assert any("aten.mm" in r["what"] for r in rows)
        assert cli.main(["cache", "explain", keys[0][:12], "--json"]) == 0
        explained = json.loads(capsys.readouterr().out)
        assert explained["components"]["compiler"] == torchneuron.compiler.compiler_version()
        assert cli.main(["cache", "explain", "--diff", keys[0], keys[1], "--json"]) == 0
        diff = json.loads(capsys.readouterr().out)
        assert set(diff) == {"mlir_sha256", "op"}  # same compiler, target, flags, versions
        bundle = tmp_path / "warm.tar.gz"
        assert cli.main(["cache", "export", str(bundle)]) == 0
        capsys.readouterr()
        # Ship to another machine: import, verify, then a restart compiles nothing.
        dst = tmp_path / "dst"
        torchneuron.config.set(cache_dir=str(dst))
        assert cli.main(["cache", "import", str(bundle), "--json"]) == 0
        imported = json.loads(capsys.readouterr().out)
        assert imported["executables"] == len(keys) and imported["rejected"] == 0
        assert cli.main(["cache", "verify"]) == 0
        capsys.readouterr()
        stats, _ = run_python(WORKLOAD, dst)
        assert stats["compiles"] == 0
        # A tampered bundle: the bad executable is rejected, the rest imported.
        evil = tmp_path / "evil.tar.gz"
        with tarfile.open(bundle) as tin, tarfile.open(evil, "w:gz") as tout:
            for member in tin:
                data = tin.extractfile(member).read()
                if member.name.endswith(".vmfb") and keys[0] in member.name:
                    data = data[:-10] + b"0123456789"
                member.size = len(data)
                import io

                tout.addfile(member, io.BytesIO(data))
            escape = tarfile.TarInfo("../../escape.vmfb")
            escape.size = 1
            tout.addfile(escape, io.BytesIO(b"x"))
        torchneuron.config.set(cache_dir=str(tmp_path / "dst2"))
        assert cli.main(["cache", "import", str(evil), "--json"]) == 1
        result = json.loads(capsys.readouterr().out)
        assert result["rejected"] == 2 and result["executables"] == len(keys) - 1
        assert not (tmp_path / "escape.vmfb").exists()
        assert cli.main(["cache", "clear"]) == 0
        assert exe_files(tmp_path / "dst2") == []
    finally:
        torchneuron.config.set(cache_dir=saved)


@pytest.mark.op_mode  # per-op compiles, cache entries and launches
def test_progress_line_only_on_request_or_terminal(tmp_path):
    _, quiet = run_python(WORKLOAD, tmp_path / "a")
    assert "neuron: compiling" not in quiet  # stderr is a pipe
    _, shown = run_python(WORKLOAD, tmp_path / "b", env={"TORCHNEURON_PROGRESS": "on"})
    assert "neuron: compiling" in shown and "done" in shown
