"""Only trusted code is loaded from shared layers (issue 11): with a cache
secret, entries from Redis, the compile service and the job's c10d store carry
an HMAC and are refused without a valid one; the compile service and its
clients prove to each other that they hold the secret; without a secret the
service stays on loopback and a remote store warns. Every server is the real
one (see servers.py)."""

import hashlib
import json
import os
import socket
import struct
import subprocess
import tarfile
import threading

import pytest
import servers
import torch
from test_persistent_cache import exe_files, run_python

import torchneuron
from torchneuron.cache import entry, leader, trust
from torchneuron.cache import service_protocol as protocol
from torchneuron.cache.service_client import ServiceClient, ServiceUnavailable

# Two ops checked against CPU (fewer than WORKLOAD's: each run compiles them all).
TINY_WORKLOAD = """
import json, warnings
import torch, torchneuron
warnings.simplefilter("always")
x = torch.linspace(-2, 2, 24).reshape(4, 6)
torch.testing.assert_close(torch.tanh(x.neuron() * 3).cpu(), torch.tanh(x * 3))
s = torchneuron.compile_stats()
print("STATS " + json.dumps({"compiles": s["compiles"], "sources": s["sources"],
                             "remote_untrusted": s.get("remote_untrusted", 0)}))
"""

SECRET = "correct horse battery staple 42"
OTHER_SECRET = "an entirely different secret 17"


@pytest.fixture(autouse=True)
def _fresh_warnings():
    """Each test sees the warnings given once per process as if for the first time."""
    trust._warned.clear()
    yield
    trust._warned.clear()


def _header(blob: bytes) -> dict:
    (n,) = struct.unpack(">I", blob[4:8])
    return json.loads(blob[8 : 8 + n])


def _swap_executable(blob: bytes, vmfb: bytes) -> bytes:
    """The entry with other bytes and a matching checksum, its MAC kept: what
    someone who can write the store (but has no secret) would make."""
    header = dict(_header(blob), size=len(vmfb), sha256=hashlib.sha256(vmfb).hexdigest())
    raw = json.dumps(header, sort_keys=True).encode()
    return entry.MAGIC + struct.pack(">I", len(raw)) + raw + vmfb


def _pack_with(secret: str, key: str, vmfb: bytes) -> bytes:
    saved = torchneuron.config.get("cache_secret")
    torchneuron.config.set(cache_secret=secret)
    try:
        return entry.pack(key, vmfb)
    finally:
        torchneuron.config.set(cache_secret=saved)


# -- the secret ---------------------------------------------------------------------

def test_key_file_must_be_private_and_the_secret_is_never_shown(client_settings, tmp_path, capsys):
    from torchneuron import cli

    key_file = tmp_path / "cache.key"
    key_file.write_text(SECRET + "\n")
    key_file.chmod(0o644)
    torchneuron.config.set(cache_secret_file=str(key_file))
    with pytest.raises(trust.SecretError, match=r"accessible by group or others \(mode 0644\).*chmod 600"):
        trust.secret()
    key_file.chmod(0o600)
    assert trust.secret() == SECRET.encode()  # the file's trailing newline is not part of it
    torchneuron.config.set(cache_secret=SECRET)
    with pytest.raises(trust.SecretError, match="not both"):
        trust.secret()
    torchneuron.config.set(cache_secret_file="", cache_secret="short")
    with pytest.raises(trust.SecretError, match="at least 16"):
        trust.secret()
    torchneuron.config.set(cache_secret=SECRET)
    assert torchneuron.config.as_dict()["cache_secret"] == "set"
    assert SECRET not in repr(torchneuron.config.settings)
    assert cli.main(["info", "--json"]) == 0
    out = capsys.readouterr().out
    assert SECRET not in out and json.loads(out)["settings"]["cache_secret"] == "set"


# -- the remote store (Redis) ---------------------------------------------------------

@pytest.mark.op_mode  # per-op compiles, cache entries and launches
def test_remote_entries_without_a_valid_signature_are_refused_and_recompiled(redis_server, tmp_path):
    url, _, client = redis_server
    # A host without the secret fills the store, warned once that it is trusted by checksum only.
    first, err = run_python(TINY_WORKLOAD, tmp_path / "a", env={"TORCHNEURON_REMOTE_CACHE": url})
    assert first["compiles"] == 2 and len(client.keys("torchneuron:exe:*")) == 2
    assert err.count("trusted by checksum only") == 1
    # A host with the secret refuses both unsigned entries, compiles and replaces them (signed);
    # the workload checks its results against CPU.
    signed = {"TORCHNEURON_REMOTE_CACHE": url, "TORCHNEURON_CACHE_SECRET": SECRET}
    second, err = run_python(TINY_WORKLOAD, tmp_path / "b", env=signed)
    assert second["remote_untrusted"] == 2 and second["compiles"] == 2 and second["sources"]["remote"] == 0
    assert err.count("refused an executable from the remote executable cache") == 1
    assert "trusted by checksum only" not in err
    assert all("hmac" in _header(client.get(k)) for k in client.keys("torchneuron:exe:*"))
    # One signed entry is then given the other's executable, its checksum fixed up: refused;
    # the other is used.
    victim, donor = sorted(client.keys("torchneuron:exe:*"))
    donor_vmfb = entry.unpack(client.get(donor), donor.decode().removeprefix("torchneuron:exe:"))[0]
    client.set(victim, _swap_executable(client.get(victim), donor_vmfb))
    third, _ = run_python(TINY_WORKLOAD, tmp_path / "c", env=signed)
    assert third["remote_untrusted"] == 1 and third["compiles"] == 1 and third["sources"]["remote"] == 1


def test_refused_remote_entry_is_deleted(redis_server, client_settings):
    from torchneuron.cache.remote import RemoteStore

    url, _, client = redis_server
    key = "ab" * 32
    client.set("torchneuron:exe:" + key, _pack_with("", key, b"not really code"))
    torchneuron.config.set(cache_secret=SECRET)
    store = RemoteStore(url)
    with pytest.warns(RuntimeWarning, match="refused an executable from the remote executable cache"):
        assert store.get(key) is None
    assert store.stats()["remote_untrusted"] == 1 and store.stats()["remote_corrupt"] == 0
    assert not client.exists("torchneuron:exe:" + key)


# -- the compile service ---------------------------------------------------------------

@pytest.fixture
def tcp_service(tmp_path):
    """A real compile service on loopback TCP that holds SECRET."""
    address = f"127.0.0.1:{servers.free_port()}"
    proc = servers.start_compile_service(address, tmp_path / "service-cache", env={"TORCHNEURON_CACHE_SECRET": SECRET})
    yield address, proc
    servers.stop(proc)


def _health_with(secret: str, address: str) -> dict:
    torchneuron.config.set(cache_secret=secret)
    return ServiceClient(address).health()


def test_service_with_a_secret_refuses_clients_that_cannot_prove_it(tcp_service, client_settings):
    address, _ = tcp_service
    assert _health_with(SECRET, address)["status"] == "ok"
    for secret, why in (("", "requires clients to prove"), (OTHER_SECRET, "did not prove")):
        with pytest.warns(RuntimeWarning, match="does not share this process's cache secret"), \
                pytest.raises(ServiceUnavailable, match=why):
            _health_with(secret, address)
    # A peer that skips the handshake is told why and dropped, before the service reads its request.
    host, port = address.split(":")
    with socket.create_connection((host, int(port))) as raw:
        protocol.send(raw, {"op": "compile", "key": "0" * 64}, b"module {}")
        reply, _ = protocol.recv(raw)
        assert reply["status"] == "unauthorized" and "requires clients to prove" in reply["error"]
        assert raw.recv(1) == b""  # closed
    assert _health_with(SECRET, address)["unauthorized"] == 3


def test_client_with_a_secret_refuses_a_service_without_one(service, client_settings):
    address, _ = service  # unix socket, no secret: fine for clients without one...
    assert _health_with("", address)["status"] == "ok"
    with pytest.warns(RuntimeWarning, match="does not share"), pytest.raises(ServiceUnavailable, match="no cache secret"):
        _health_with(SECRET, address)  # ...but it cannot sign what it sends


@pytest.mark.op_mode  # per-op compiles, cache entries and launches
def test_ops_compile_through_a_service_that_shares_the_secret(tcp_service, client_settings):
    address, _ = tcp_service
    torchneuron.config.set(compile_service=address, cache_secret=SECRET)
    before = torchneuron.compile_stats()
    x = torch.randn(10, 3)
    torch.testing.assert_close(torch.expm1(x.neuron() * 0.5).cpu(), torch.expm1(x * 0.5))
    after = torchneuron.compile_stats()
    assert after["sources"]["service"] - before["sources"]["service"] == 2
    assert after["compiles"] == before["compiles"] and after["service_untrusted"] == before["service_untrusted"]


@pytest.mark.op_mode  # per-op compiles, cache entries and launches
def test_ops_compile_locally_when_the_service_refuses_this_process(tcp_service, client_settings):
    address, _ = tcp_service
    torchneuron.config.set(compile_service=address, cache_secret=OTHER_SECRET)
    before = torchneuron.compile_stats()
    x = torch.randn(6, 5)
    with pytest.warns(RuntimeWarning, match="does not share") as record:
        torch.testing.assert_close(torch.log1p(x.neuron().abs()).cpu(), torch.log1p(x.abs()))
    assert sum("compile service" in str(w.message) for w in record) == 1
    after = torchneuron.compile_stats()
    assert after["compiles"] - before["compiles"] == 2 and after["sources"]["service"] == before["sources"]["service"]


class _TamperingProxy:
    """Relays a client's connection to the service unchanged (the handshake
    too) but swaps the executable in each reply, fixing up its checksum."""

    def __init__(self, upstream: str):
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.swapped = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            up = protocol.connect(self.upstream, timeout=120)
            threading.Thread(target=self._requests, args=(down, up), daemon=True).start()
            threading.Thread(target=self._replies, args=(up, down), daemon=True).start()

    @staticmethod
    def _requests(src, dst):
        try:
            while chunk := src.recv(1 << 16):
                dst.sendall(chunk)
        except OSError:
            pass

    def _replies(self, src, dst):
        try:
            while True:
                header, payload = protocol.recv(src)
                if payload.startswith(entry.MAGIC):
                    payload = _swap_executable(payload, payload[-64:] + b"\0" * 64)
                    self.swapped += 1
                protocol.send(dst, header, payload)
        except OSError:
            dst.close()

    def close(self):
        self.listener.close()


@pytest.mark.op_mode  # per-op compiles, cache entries and launches
def test_signed_reply_tampered_in_transit_is_refused(tcp_service, client_settings):
    address, _ = tcp_service
    proxy = _TamperingProxy(address)
    try:
        torchneuron.config.set(compile_service=proxy.address, cache_secret=SECRET)
        before = torchneuron.compile_stats()
        x = torch.randn(8, 4)
        with pytest.warns(RuntimeWarning, match="refused an executable from the compile service"):
            torch.testing.assert_close(torch.sigmoid(x.neuron()).cpu(), torch.sigmoid(x))
        after = torchneuron.compile_stats()
        assert proxy.swapped == 1 and after["service_untrusted"] - before["service_untrusted"] == 1
        assert after["compiles"] - before["compiles"] == 1  # compiled here instead
    finally:
        proxy.close()


def test_service_does_not_start_off_loopback_without_a_secret_or_with_a_readable_key_file(
        tmp_path, client_settings, capsys):
    from torchneuron import cli

    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHNEURON_CACHE_SECRET")}
    result = subprocess.run(servers.compile_service_command("0.0.0.0:0", tmp_path / "cache"), env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "listening" not in result.stdout
    assert "refusing to listen on 0.0.0.0:0 without a cache secret" in result.stderr
    assert "Traceback" not in result.stderr
    key_file = tmp_path / "cache.key"
    key_file.write_text(SECRET)
    key_file.chmod(0o640)
    torchneuron.config.set(cache_secret_file=str(key_file))
    assert cli.main(["compile-service", "--listen", "0.0.0.0:0", "--cache-dir", str(tmp_path / "cache")]) == 1
    out = capsys.readouterr()
    assert "chmod 600" in out.err and "listening" not in out.out


# -- leader-compiles (the job's c10d store) -------------------------------------------

def test_leader_entry_without_a_valid_signature_is_refused(client_settings, monkeypatch):
    import torch.distributed as dist

    store = dist.HashStore()  # the c10d store class a job's ranks meet in, in this process
    monkeypatch.setattr(leader, "_store", lambda: store)
    torchneuron.config.set(cache_secret=SECRET)
    compiled = []

    def compile_here():
        compiled.append(1)
        return b"compiled here", 0.1, "compiled"

    def fetch(key: str, blob: bytes):
        store.add(f"torchneuron/claim/{key}", 1)  # another rank leads
        store.set(f"torchneuron/exe/{key}", blob)
        return leader.compile_or_fetch(key, compile_here)

    before = torchneuron.compile_stats()["peer_untrusted"]
    with pytest.warns(RuntimeWarning, match="refused an executable from another rank"):
        assert fetch("k1", _pack_with("", "k1", b"unsigned"))[2] == "compiled"
    assert fetch("k2", _pack_with(OTHER_SECRET, "k2", b"another secret"))[2] == "compiled"
    assert fetch("k3", _pack_with(SECRET, "k3", b"from the leader")) == (b"from the leader", 0.0, "peer")
    assert len(compiled) == 2 and torchneuron.compile_stats()["peer_untrusted"] - before == 2


# -- cache archives ---------------------------------------------------------------------

@pytest.mark.op_mode  # per-op compiles, cache entries and launches
def test_archive_import_with_a_secret_takes_only_members_signed_with_it(tmp_path, client_settings):
    from torchneuron import cli

    src = tmp_path / "client-cache"  # client_settings' cache directory: fill it here
    x = torch.randn(3, 11, 2)  # a shape no other test compiles, so it is compiled into src
    torch.testing.assert_close(torch.atan(x.neuron()).cpu(), torch.atan(x))
    n = len(exe_files(src))
    assert n >= 1
    unsigned, signed = tmp_path / "unsigned.tar.gz", tmp_path / "signed.tar.gz"
    assert cli.main(["cache", "export", str(unsigned)]) == 0
    torchneuron.config.set(cache_secret=SECRET)
    assert cli.main(["cache", "export", str(signed)]) == 0
    with tarfile.open(signed) as tar:
        assert all("hmac" in json.loads(tar.extractfile(m).read()) for m in tar if m.name.endswith(".json"))
    torchneuron.config.set(cache_dir=str(tmp_path / "dst"))
    assert cli.main(["cache", "import", str(unsigned)]) == 1
    assert exe_files(tmp_path / "dst") == []
    assert cli.main(["cache", "import", str(signed)]) == 0
    assert len(exe_files(tmp_path / "dst")) == n
