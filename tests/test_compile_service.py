"""The shared compile service, the remote store and leader-compiles in a
distributed job (issue: persistent executable cache and a shared compile
service). Every server is the real one, started and stopped here."""

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from servers import free_port, wait_for
from test_persistent_cache import WORKLOAD, run_python

import torchneuron
from torchneuron.compiler import CompileError, target_flags
from torchneuron.cache.service_client import ServiceClient, ServiceUnavailable


def _lowered(fn, *shapes):
    """(key, mlir, what) of one op call, as the eager path would send it."""
    from torchneuron.cache import cache_key
    from torchneuron.dispatch.op_info import op_info
    from torchneuron.lowering import lower_call, signature_of

    args = tuple(torch.randn(*s).neuron() for s in shapes)
    info = op_info(fn)
    sig = signature_of(fn, info, args, {})
    lowered = lower_call(fn, info, sig)
    return cache_key(lowered.mlir, *target_flags()), lowered.mlir, lowered.what


def test_service_socket_is_private_and_reports_health(service):
    address, _ = service
    assert stat.S_IMODE(os.stat(address).st_mode) == 0o600
    health = ServiceClient(address).health()
    assert health["status"] == "ok" and health["workers"] == 1
    assert health["compiler"] == torchneuron.compiler.compiler_version()


def test_identical_requests_merge_into_one_compile(service):
    address, _ = service
    key, mlir, what = _lowered(torch.ops.aten.sin.default, (13, 7))
    results, errors = [], []

    def request():
        try:
            results.append(ServiceClient(address).compile(key, mlir, what, target_flags()))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=request) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(results) == 4
    assert len({r[0] for r in results}) == 1  # every client got the same executable
    health = ServiceClient(address).health()
    assert health["compiles"] == 1
    assert health["merged"] + health["cache_hits"] == 3 and health["merged"] >= 1


def test_service_reports_compile_errors_and_refuses_mismatched_keys(service):
    from torchneuron.cache import cache_key

    address, _ = service
    client = ServiceClient(address)
    bad = "module { this is not mlir }"
    with pytest.raises(CompileError, match="error"):
        client.compile(cache_key(bad, *target_flags()), bad, "aten.fake(float32[3])", target_flags())
    _, mlir, what = _lowered(torch.ops.aten.cos.default, (5, 3))
    with pytest.warns(RuntimeWarning, match="refused"), pytest.raises(ServiceUnavailable, match="does not match"):
        client.compile("0" * 64, mlir, what, target_flags())


@pytest.mark.op_mode  # per-op compiles, cache entries and launches
def test_clients_compile_through_the_service(service, client_settings):
    address, _ = service
    torchneuron.config.set(compile_service=address)
    before = torchneuron.compile_stats()
    x = torch.randn(11, 6)
    torch.testing.assert_close(torch.erf(x.neuron() * 3).cpu(), torch.erf(x * 3))
    after = torchneuron.compile_stats()
    assert after["sources"]["service"] - before["sources"]["service"] == 2
    assert after["compiles"] == before["compiles"]  # nothing compiled in this process
    assert ServiceClient(address).health()["compiles"] == 2


@pytest.mark.op_mode  # per-op compiles, cache entries and launches
def test_service_killed_mid_compile_clients_compile_locally(service, client_settings):
    address, proc = service
    torchneuron.config.set(compile_service=address)
    # Many tensors: one executable that takes a while to compile.
    xs = [torch.randn(3, i + 1) for i in range(48)]
    result, errors = [], []

    def step():
        try:
            result.append([t.cpu() for t in torch._foreach_mul([x.neuron() for x in xs], 1.5)])
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    before = torchneuron.compile_stats()["compiles"]
    with pytest.warns(RuntimeWarning, match="compile service .* is unavailable"):
        worker = threading.Thread(target=step)
        worker.start()
        probe = ServiceClient(address)
        wait_for(lambda: probe.health()["running"] == 1, what="the service to start compiling")
        proc.send_signal(signal.SIGKILL)
        worker.join(180)
    assert not worker.is_alive() and not errors
    for got, x in zip(result[0], xs):
        torch.testing.assert_close(got, x * 1.5)
    assert torchneuron.compile_stats()["compiles"] == before + 1  # compiled here instead


@pytest.mark.op_mode  # per-op compiles, cache entries and launches
def test_unreachable_service_costs_one_warning(client_settings, tmp_path):
    torchneuron.config.set(compile_service=str(tmp_path / "nobody-listens.sock"))
    x = torch.randn(9, 4)
    with pytest.warns(RuntimeWarning, match="compile service") as record:
        torch.testing.assert_close(torch.atan(x.neuron()).cpu(), torch.atan(x))
        torch.testing.assert_close(torch.asinh(x.neuron()).cpu(), torch.asinh(x))
    assert sum("compile service" in str(w.message) for w in record) == 1


def test_four_processes_share_one_service(service, tmp_path):
    address, _ = service
    env = {"TORCHNEURON_COMPILE_SERVICE": address}
    procs = []
    for i in range(4):  # separate cache directories: every process must ask the service
        full = dict(os.environ, TORCHNEURON_CACHE_DIR=str(tmp_path / f"c{i}"), TORCHNEURON_DEVICE_COUNT="1", **env)
        procs.append(subprocess.Popen([sys.executable, "-c", textwrap.dedent(WORKLOAD)], env=full,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-2000:] for _, e in outs]
    stats = [json.loads(line[6:]) for out, _ in outs for line in out.splitlines() if line.startswith("STATS ")]
    keys = stats[0]["signatures"]
    assert all(s["compiles"] == 0 and s["sources"]["service"] == keys for s in stats)
    health = ServiceClient(address).health()
    assert health["compiles"] == keys  # total compiles == unique keys
    assert health["requests"] == 4 * keys


# -- the remote store (Redis) ---------------------------------------------------

@pytest.mark.op_mode  # per-op compiles, cache entries and launches
def test_remote_store_shares_executables_across_hosts(redis_server, tmp_path):
    url, _, client = redis_server
    env = {"TORCHNEURON_REMOTE_CACHE": url}
    first, _ = run_python(WORKLOAD, tmp_path / "host-a", env=env)
    assert first["compiles"] >= 4
    assert len(client.keys("torchneuron:exe:*")) == first["compiles"]
    second, _ = run_python(WORKLOAD, tmp_path / "host-b", env=env)  # another host: empty disk
    assert second["compiles"] == 0 and second["sources"]["remote"] == first["compiles"]
    # A corrupt remote entry is caught by its checksum, dropped and rebuilt.
    victim = min(client.keys("torchneuron:exe:*"))
    blob = bytearray(client.get(victim))
    blob[-20] ^= 0xFF
    client.set(victim, bytes(blob))
    third, _ = run_python(WORKLOAD, tmp_path / "host-c", env=env)
    assert third["compiles"] == 1 and third["sources"]["remote"] == first["compiles"] - 1


@pytest.mark.op_mode  # per-op compiles, cache entries and launches
def test_redis_down_or_going_down_falls_back_without_hanging(redis_server, client_settings):
    url, proc, _ = redis_server
    torchneuron.config.set(remote_cache=f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    x = torch.randn(7, 5)
    with pytest.warns(RuntimeWarning, match="remote executable cache .* unavailable"):
        torch.testing.assert_close(torch.sinh(x.neuron()).cpu(), torch.sinh(x))
    # A server that goes down mid-run.
    torchneuron.config.set(remote_cache=url)
    torch.testing.assert_close(torch.cosh(x.neuron()).cpu(), torch.cosh(x))
    assert torchneuron.compile_stats()["remote_puts"] >= 1
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    start = time.monotonic()
    with pytest.warns(RuntimeWarning, match="remote executable cache .* unavailable"):
        torch.testing.assert_close(torch.tanh(x.neuron() + 1).cpu(), torch.tanh(x + 1))
    assert time.monotonic() - start < 30


# -- leader-compiles inside a torch.distributed job ---------------------------------

def test_a_leader_whose_compile_breaks_lets_the_other_ranks_compile_without_waiting(monkeypatch):
    """The claimant's compile raising something other than a compile error
    (here an OSError) must not leave the others waiting the leader timeout:
    they compile the key themselves, and an exiting rank stops waiting."""
    import torch.distributed as dist

    from torchneuron.cache import leader

    store = dist.HashStore()  # the c10d store class a job's ranks meet in, in this process
    monkeypatch.setattr(leader, "_store", lambda: store)
    monkeypatch.setattr(torchneuron.config.settings, "leader_timeout", 600.0)
    claimed, done = threading.Event(), []

    def broken():
        claimed.set()
        time.sleep(0.5)  # the follower is waiting by now
        raise OSError("disk full")

    def leader_rank():
        with pytest.raises(OSError, match="disk full"):
            leader.compile_or_fetch("k-broken", broken)

    def follower_rank():
        claimed.wait()
        done.append(leader.compile_or_fetch("k-broken", lambda: (b"compiled here", 0.1, "compiled")))

    timeouts = leader.stats.timeouts
    threads = [threading.Thread(target=leader_rank), threading.Thread(target=follower_rank)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank is still waiting for the broken leader"
    assert done == [(b"compiled here", 0.1, "compiled")] and leader.stats.timeouts == timeouts

    # A claimant that never publishes (its process died): an exiting rank stops waiting.
    store.add("torchneuron/claim/k-dead", 1)
    monkeypatch.setattr(leader, "_exiting", threading.Event())
    waiter = threading.Thread(target=lambda: done.append(leader.compile_or_fetch("k-dead", lambda: (b"here", 0.0, "compiled"))))
    waiter.start()
    time.sleep(1.5)
    assert waiter.is_alive()  # waiting for the leader
    leader._exiting.set()
    waiter.join(60)
    assert not waiter.is_alive() and done[-1] == (b"here", 0.0, "compiled")
    assert leader.stats.timeouts == timeouts + 1


def test_leader_compiles_each_key_once_for_the_job(tmp_path):
    code = """
    import json, os, sys
    import torch, torch.distributed as dist, torchneuron
    rank = int(sys.argv[1])
    dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2)
    torch.manual_seed(0)
    x = torch.randn(10, 12)
    got = torch.log_softmax(x.neuron() @ x.neuron().T, -1).exp().cpu()
    torch.testing.assert_close(got, torch.log_softmax(x @ x.T, -1).exp(), rtol=1e-4, atol=1e-4)
    s = torchneuron.compile_stats()
    print("STATS " + json.dumps({"compiles": s["compiles"], "sources": s["sources"], "signatures": s["signatures"]}))
    dist.barrier()
    dist.destroy_process_group()
    """
    store = tmp_path / "store"
    procs = []
    for rank in range(2):  # separate cache directories: as if on two hosts
        env = dict(os.environ, TORCHNEURON_CACHE_DIR=str(tmp_path / f"host{rank}"), TORCHNEURON_DEVICE_COUNT="1")
        procs.append(subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), str(rank), str(store)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-2000:] for _, e in outs]
    stats = [json.loads(line[6:]) for out, _ in outs for line in out.splitlines() if line.startswith("STATS ")]
    keys = stats[0]["signatures"]
    assert sum(s["compiles"] for s in stats) == keys  # each key compiled by one rank
    assert sum(s["sources"]["peer"] for s in stats) == keys  # and fetched by the other
