"""The compiled target is explicit (issue 11, "trustworthy results").

Executables are compiled for a CPU named by LLVM's name and feature list,
never "host", and the cache key holds them: a cache filled for one CPU is
never served to a process that compiles for another, through any layer (disk,
Redis, the compile service, an exported archive). The other CPU here is one
this host can run (TORCHNEURON_TARGET_CPU=haswell on an AVX-512 host), so
results are still checked against CPU.
"""

import contextlib
import os
import io
import json
import pathlib
import re
import tarfile

import pytest
import torch
from test_compile_service import _lowered
from test_persistent_cache import run_python

import torchneuron
from torchneuron.cache import cache_key
from torchneuron.cache.key import key_components
from torchneuron.compiler import target_cpu, target_flags
from torchneuron.compiler.iree_compile import cpu_flags
from torchneuron.cache.service_client import ServiceClient, ServiceUnavailable

# Two tiny ops (mul by a scalar, tanh), checked against CPU; prints where
# their executables came from and which CPU they were compiled for.
TINY = """
import json
import torch, torchneuron
torch.manual_seed(0)
x = torch.randn(6, 5)
torch.testing.assert_close(torch.tanh(x.neuron() * 3).cpu(), torch.tanh(x * 3))
s = torchneuron.compile_stats()
print("STATS " + json.dumps({"compiles": s["compiles"], "sources": s["sources"], "signatures": s["signatures"],
                             "cpu": torchneuron.compiler.target_cpu.configured().name}))
"""


def _runnable_other_cpu() -> str:
    """A CPU description this host can run whose flags differ from the host's."""
    host = target_cpu.host()
    if host.arch != "x86_64":
        pytest.skip("the other CPUs named here are x86 ones")
    for name in ("haswell", "x86-64-v3", "x86-64-v2"):
        cpu = target_cpu.resolve(name)
        if not target_cpu.missing_on_host(cpu) and cpu_flags(cpu) != cpu_flags(host):
            return name
    pytest.skip("no other x86 CPU description differs from this host's")


def _unrunnable_cpu() -> str:
    """A CPU description with features this host lacks."""
    for name in ("znver4", "sapphirerapids", "graniterapids", "znver3", "icelake-server", "znver2", "skylake-avx512"):
        try:
            if target_cpu.missing_on_host(target_cpu.resolve(name)):
                return name
        except RuntimeError:
            continue
    pytest.skip("this host has every feature of the CPUs named here")


def _run(cache_dir, cpu: str, **env):
    # op mode: counts of per-op compiles (the module fixture below starts
    # before the op_mode marker sets the environment)
    env = dict(env, TORCHNEURON_TARGET_CPU=cpu, TORCHNEURON_EAGER_MODE="op", TORCHNEURON_COMPILE_WAIT="1")
    stats, _ = run_python(TINY, cache_dir, env=env)
    return stats


# -- resolution and flags -------------------------------------------------------

def test_flags_name_the_resolved_cpu_and_the_key_records_it():
    host = target_cpu.host()
    backend, flags = target_flags()
    assert backend == "llvm-cpu"
    assert not any(f.endswith("=host") for f in flags), flags
    assert f"--iree-llvmcpu-target-cpu={host.name}" in flags
    assert f"--iree-llvmcpu-target-cpu-features={host.features_text}" in flags
    assert "--iree-opt-data-tiling=true" in flags and "--iree-input-demote-f64-to-f32=false" in flags
    components = key_components("module {}", backend, flags)
    assert components["target_cpu"] == host.name
    assert components["target_cpu_features"] == host.features_text
    # Each feature once, last mention winning (LLVM lists the CPU's defaults, then what it detected).
    names = [f[1:] for f in host.features]
    assert len(names) == len(set(names)) and names == sorted(names)
    assert target_cpu.normalize_features("+a,+b,-a,+c,-c,+c") == ("-a", "+b", "+c")


def test_microkernels_only_with_avx512():
    if target_cpu.host().arch != "x86_64":
        pytest.skip("the measurement behind the choice is on x86")
    avx2 = cpu_flags(target_cpu.resolve("haswell"))
    avx512 = cpu_flags(target_cpu.resolve("skylake-avx512"))
    assert "--iree-llvmcpu-enable-ukernels=none" in avx2 and "--iree-opt-data-tiling=true" in avx2
    assert "--iree-llvmcpu-enable-ukernels=all" in avx512 and "--iree-opt-data-tiling=true" in avx512


def test_resolution_is_kept_in_memory_and_on_disk(tmp_path, monkeypatch):
    saved = torchneuron.config.settings.cache_dir
    torchneuron.config.set(cache_dir=str(tmp_path))
    probes = []
    real_probe = target_cpu._probe
    monkeypatch.setattr(target_cpu, "_probe", lambda d: probes.append(d) or real_probe(d))
    try:
        target_cpu.resolve.cache_clear()
        first = target_cpu.resolve("haswell")
        assert target_cpu.resolve("haswell") is first and probes == ["haswell"]
        assert len(list((tmp_path / "target").glob("*.json"))) == 1
        target_cpu.resolve.cache_clear()  # as a new process: read from disk, no compiler
        assert target_cpu.resolve("haswell") == first and probes == ["haswell"]
    finally:
        target_cpu.resolve.cache_clear()
        torchneuron.config.set(cache_dir=saved)


def test_explicit_cpu_flags_generate_the_same_code_as_host(tmp_path):
    """The normalized feature list means to the compiler what "host" means."""
    import iree.compiler as ireec

    mlir = """func.func @f(%a: tensor<32x32xf32>, %b: tensor<32x32xf32>) -> tensor<32x32xf32> {
      %z = tensor.empty() : tensor<32x32xf32>
      %c = arith.constant 0.0 : f32
      %f = linalg.fill ins(%c : f32) outs(%z : tensor<32x32xf32>) -> tensor<32x32xf32>
      %r = linalg.matmul ins(%a, %b : tensor<32x32xf32>, tensor<32x32xf32>) outs(%f : tensor<32x32xf32>) -> tensor<32x32xf32>
      %e = math.exp %r : tensor<32x32xf32>
      return %e : tensor<32x32xf32>
    }"""
    _, flags = target_flags()
    literal = [f for f in flags if not f.startswith(target_cpu.FEATURES_FLAG)]
    literal = [target_cpu.CPU_FLAG + "host" if f.startswith(target_cpu.CPU_FLAG) else f for f in literal]
    assembly = []
    for name, variant in (("a", flags), ("b", literal)):  # names of one length: it is in the debug info
        out = tmp_path / name
        ireec.compile_str(mlir, target_backends=["llvm-cpu"],
                          extra_args=[*variant, f"--iree-hal-dump-executable-files-to={out}"])
        (s_file,) = out.glob("*.s")
        text = s_file.read_text().replace(str(out), "DUMP")
        assembly.append(text)
    assert assembly[0] == assembly[1]


@pytest.mark.op_mode  # per-op compiles, cache entries and launches
def test_describing_a_cpu_this_host_cannot_run_is_refused():
    name = _unrunnable_cpu()
    missing = target_cpu.missing_on_host(target_cpu.resolve(name))
    x = torch.randn(4, 3)
    try:
        torchneuron.config.set(target_cpu=name)
        with pytest.raises(RuntimeError, match=f"TORCHNEURON_TARGET_CPU='{name}'.*lacks: {re.escape(missing[0])}"):
            torch.cos(x.neuron() + 0.25).cpu()
        # Only compiling for it (what a compile service does for its clients) is allowed.
        _, flags = target_flags(to_run=False)
        assert f"--iree-llvmcpu-target-cpu={target_cpu.resolve(name).name}" in flags
    finally:
        torchneuron.config.set(target_cpu="host")
    torch.testing.assert_close(torch.cos(x.neuron() + 0.25).cpu(), torch.cos(x + 0.25))


def test_unknown_cpu_description_names_the_known_ones():
    target_cpu.resolve.cache_clear()
    with pytest.raises(RuntimeError, match="no CPU the compiler knows.*haswell"):
        target_cpu.resolve("no-such-cpu")
    with pytest.raises(RuntimeError, match="not a CPU name"):
        target_cpu.resolve("host --iree-hal-target-backends=vmvx")


def test_info_shows_the_target_cpu(capsys):
    from torchneuron import cli

    assert cli.main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)["target_cpu"]
    host = target_cpu.host()
    assert info["described"] == "host" and info["name"] == host.name and info["missing_on_host"] == []
    assert set(info["vector_features"]) <= host.enabled
    if host.arch == "x86_64":
        assert "avx2" in info["vector_features"] or not host.has("avx2")
        assert info["microkernels"] == host.has("avx512f")
    assert cli.main(["info"]) == 0
    text = capsys.readouterr().out
    assert f"target_cpu         {host.name} (TORCHNEURON_TARGET_CPU=host; runs here)" in text
    assert "vector_features" in text


# -- a cache filled for one CPU is not served to another -----------------------------

@contextlib.contextmanager
def _cache_dir(path):
    """This process's cache directory, for the CLI's commands."""
    saved = torchneuron.config.settings.cache_dir
    torchneuron.config.set(cache_dir=str(path))
    try:
        yield
    finally:
        torchneuron.config.set(cache_dir=saved)


@pytest.fixture(scope="module")
def two_cpus(tmp_path_factory):
    """One cache directory filled by a process for this host's CPU, exported
    (as host.tar.gz), then used by a process describing another CPU."""
    from torchneuron import cli

    other = _runnable_other_cpu()
    base = tmp_path_factory.mktemp("two-cpus")
    first = _run(base / "cache", "host")
    with _cache_dir(base / "cache"):
        assert cli.main(["cache", "export", str(base / "host.tar.gz")]) == 0
    second = _run(base / "cache", other)
    return {"base": base, "other": other, "first": first, "second": second, "n": first["signatures"]}


@pytest.mark.op_mode  # per-op compiles, cache entries and launches
def test_disk_cache_for_one_cpu_is_not_loaded_for_another(two_cpus):
    cache, other, n = two_cpus["base"] / "cache", two_cpus["other"], two_cpus["n"]
    first, second = two_cpus["first"], two_cpus["second"]
    assert first["sources"]["compiled"] == n >= 2 and first["cpu"] == target_cpu.host().name
    # Same directory, another CPU: every op compiled again, nothing loaded.
    assert second["sources"]["compiled"] == n and second["sources"]["disk"] == 0
    assert second["cpu"] == target_cpu.resolve(other).name
    third = _run(cache, other)  # and that CPU's entries serve it next time
    assert third["sources"]["compiled"] == 0 and third["sources"]["disk"] == n
    # Both CPUs' entries are there, each recording its CPU.
    cpus = sorted(json.loads(p.read_text())["components"]["target_cpu"] for p in (cache / "exe").glob("*/*.json"))
    assert cpus == sorted([target_cpu.host().name] * n + [target_cpu.resolve(other).name] * n)


@pytest.mark.op_mode  # per-op compiles, cache entries and launches
def test_explain_diff_names_the_cpu_difference(two_cpus, capsys):
    from torchneuron import cli

    cache, other = two_cpus["base"] / "cache", two_cpus["other"]
    by_op: dict = {}
    for p in (cache / "exe").glob("*/*.json"):
        meta = json.loads(p.read_text())
        by_op.setdefault(meta["what"], {})[meta["components"]["target_cpu"]] = meta["key"]
    host_name, other_name = target_cpu.host().name, target_cpu.resolve(other).name
    pair = next(v for v in by_op.values() if len(v) == 2)
    a, b = pair[host_name], pair[other_name]
    with _cache_dir(cache):
        assert cli.main(["cache", "explain", "--diff", a, b, "--json"]) == 0
        diff = json.loads(capsys.readouterr().out)
        assert "mlir_sha256" not in diff and "op" not in diff  # the same op, compiled for two CPUs
        assert diff["target_cpu"] == [host_name, other_name]
        only_host = set(target_cpu.host().enabled - target_cpu.resolve(other).enabled)
        assert set(diff["target_cpu_features"]["only_in_a"]) == only_host
        assert diff["target_cpu_features"]["only_in_b"] == []
        assert f"--iree-llvmcpu-target-cpu={other_name}" in diff["flags"]["only_in_b"]
        assert cli.main(["cache", "explain", "--diff", a, b]) == 0
        text = capsys.readouterr().out
    assert f"target_cpu:\n  A: {host_name}\n  B: {other_name}" in text
    assert "features enabled only in B: -" in text
    assert max(len(line) for line in text.splitlines()) < 2000  # no two full feature lists
    if target_cpu.host().has("avx512f"):
        assert re.search(r"features enabled only in A: .*\bavx512f\b", text)


def test_exported_archive_for_one_cpu_is_not_loaded_for_another(two_cpus, tmp_path, capsys):
    from torchneuron import cli

    n = two_cpus["n"]
    with _cache_dir(tmp_path / "dst"):
        capsys.readouterr()
        assert cli.main(["cache", "import", str(two_cpus["base"] / "host.tar.gz"), "--json"]) == 0
        imported = json.loads(capsys.readouterr().out)
    assert imported["executables"] == n and imported["rejected"] == 0
    # The imported entries are for the host's CPU: a process for another compiles again.
    moved = _run(tmp_path / "dst", two_cpus["other"])
    assert moved["sources"]["compiled"] == n and moved["sources"]["disk"] == 0


@pytest.mark.op_mode  # per-op compiles, cache entries and launches
def test_import_rejects_entries_whose_components_do_not_match_their_key(two_cpus, tmp_path, capsys):
    from torchneuron import cli

    n = two_cpus["n"]
    forged = tmp_path / "forged.tar.gz"
    # One entry claims another CPU than the one its key was made for.
    with tarfile.open(two_cpus["base"] / "host.tar.gz") as tin, tarfile.open(forged, "w:gz") as tout:
        done = False
        for member in tin:
            data = tin.extractfile(member).read()
            if member.name.startswith("exe/") and member.name.endswith(".json") and not done:
                meta = json.loads(data)
                meta["components"]["target_cpu"] = "haswell"
                data = json.dumps(meta).encode()
                done = True
            member.size = len(data)
            tout.addfile(member, io.BytesIO(data))
    with _cache_dir(tmp_path / "dst"):
        capsys.readouterr()
        assert cli.main(["cache", "import", str(forged), "--json"]) == 1
        result = json.loads(capsys.readouterr().out)
    assert result["rejected"] == 1 and result["executables"] == n - 1


def test_remote_store_for_one_cpu_is_not_loaded_for_another(redis_server, tmp_path):  # noqa: F811
    other = _runnable_other_cpu()
    url, _, client = redis_server
    first = _run(tmp_path / "host-a", "host", TORCHNEURON_REMOTE_CACHE=url)
    n = first["signatures"]
    assert first["sources"]["compiled"] == n and len(client.keys("torchneuron:exe:*")) == n
    # Another host (empty disk) that describes another CPU: nothing from Redis.
    second = _run(tmp_path / "host-b", other, TORCHNEURON_REMOTE_CACHE=url)
    assert second["sources"]["compiled"] == n and second["sources"]["remote"] == 0
    assert len(client.keys("torchneuron:exe:*")) == 2 * n  # stored beside the first CPU's


def test_compile_service_compiles_for_each_clients_cpu(service, tmp_path):  # noqa: F811
    other = _runnable_other_cpu()
    address, _ = service
    first = _run(tmp_path / "c1", "host", TORCHNEURON_COMPILE_SERVICE=address)
    n = first["signatures"]
    assert first["sources"]["service"] == n and first["sources"]["compiled"] == 0
    second = _run(tmp_path / "c2", other, TORCHNEURON_COMPILE_SERVICE=address)
    assert second["sources"]["service"] == n and second["sources"]["compiled"] == 0
    health = ServiceClient(address).health()
    assert health["compiles"] == 2 * n and health["cache_hits"] == 0  # compiled again, for that CPU
    # The service's cache holds one entry per op per CPU, each naming the client's CPU.
    service_cache = pathlib.Path(address).parent / "cache" / "exe"
    cpus = sorted(json.loads(p.read_text())["components"]["target_cpu"] for p in service_cache.glob("*/*.json"))
    assert cpus == sorted([target_cpu.host().name] * n + [target_cpu.resolve(other).name] * n)


def test_compile_service_honours_explicit_flags_and_refuses_host(service, client_settings):  # noqa: F811
    address, _ = service
    client = ServiceClient(address)
    _, mlir, what = _lowered(torch.ops.aten.exp.default, (6, 2))
    # A CPU this service's host cannot run: compiling for a client is still fine.
    name = _unrunnable_cpu()
    try:
        torchneuron.config.set(target_cpu=name)
        target = target_flags(to_run=False)
    finally:
        torchneuron.config.set(target_cpu="host")
    vmfb, _, source = client.compile(cache_key(mlir, *target), mlir, what, target)
    assert source == "compiled" and len(vmfb) > 0
    # An old client's "host" would mean the service's CPU: refused, with a reason.
    backend, flags = target_flags()
    old = (backend, tuple(target_cpu.CPU_FLAG + "host" if f.startswith(target_cpu.CPU_FLAG) else f
                          for f in flags if not f.startswith(target_cpu.FEATURES_FLAG)))
    with pytest.warns(RuntimeWarning, match="refused"), pytest.raises(ServiceUnavailable, match="names no CPU"):
        client.compile(cache_key(mlir, *old), mlir, what, old)
    health = client.health()
    assert health["refused"] == 1 and health["compiles"] == 1


@pytest.mark.op_mode  # per-op compiles, cache entries and launches
def test_a_process_that_only_runs_the_compiler_does_not_load_its_python_bindings(tmp_path):
    """Resolving the CPU and compiling run iree-compile as a process; the MLIR
    Python bindings (0.33 s to load, mostly under the GIL) belong to the
    lowering worker, not to the program whose first ops run meanwhile (with
    TORCHNEURON_COMPILE_WAIT=1 the program lowers in its own process)."""
    code = """
        import json, sys, torch, torchneuron
        torchneuron.config.set(compile_wait=False)
        x = torch.arange(6.0).to("neuron")
        for _ in range(2):  # on the host while it builds, then compiled
            y = (x * 3).tanh().cpu()
            assert torch.allclose(y, (torch.arange(6.0) * 3).tanh())
            assert torchneuron.wait_for_compiles(timeout=600)
        print("STATS " + json.dumps({"compiles": torchneuron.compile_stats()["compiles"],
                                     "bindings": "iree.compiler" in sys.modules}))
    """
    stats, _ = run_python(code, tmp_path / "cache")
    assert stats["compiles"] >= 1 and stats["bindings"] is False


def test_the_compiler_command_is_the_one_the_iree_library_builds(tmp_path, monkeypatch):
    """run_compiler builds iree-compile's command line itself (not importing
    iree.compiler); it must stay the library's, and under IREE_SAVE_TEMPS it
    is the library's own, with its crash reproducer."""
    from iree.compiler.tools.core import CompilerOptions, build_compile_command_line
    from iree.compiler.tools.debugging import TempFileSaver

    from torchneuron.compiler.tool import _command

    options = dict(input_type="torch", target_backends=["llvm-cpu"], extra_args=["--compile-to=flow"])
    monkeypatch.delenv("IREE_SAVE_TEMPS", raising=False)
    with TempFileSaver.implicit() as temps:
        library = build_compile_command_line("-", temps, CompilerOptions(**options))
    ours = _command(**options)

    def normalized(command):  # tools/../_mlir_libs/x and _mlir_libs/x are one file
        out = []
        for arg in command:
            flag, eq, value = arg.rpartition("=") if arg.startswith("--") else ("", "", arg)
            out.append(flag + eq + (os.path.realpath(value) if os.sep in value else value))
        return out

    assert normalized(ours) == normalized(library)
    monkeypatch.setenv("IREE_SAVE_TEMPS", str(tmp_path))
    saved = _command(**options)
    assert any(a.startswith("--mlir-pass-pipeline-crash-reproducer=" + str(tmp_path)) for a in saved)
