"""The CPU that executables are compiled for, named explicitly.

`--iree-llvmcpu-target-cpu=host` would put the word "host" in the compile
flags and so in the cache key: a cache filled on an AVX-512 machine and read
on one without (export/import, a remote store, a compile service, a shared
directory) would hand out code that machine cannot run. Instead the CPU is
resolved once per process the way the compiler itself does it (compile a
trivial module to executable sources and read the `cpu` and `cpu_features`
of its `#hal.executable.target`), and executables are compiled with that name
and feature list spelled out.

`TORCHNEURON_TARGET_CPU` describes another CPU ("haswell", "skylake-avx512");
LLVM fills its default features. Running code compiled for a CPU with
features this host lacks would die with SIGILL, so executing processes refuse
such a description (`check_runnable`); compiling for it (the compile service
does, for its clients) is fine.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import threading
from concurrent.futures import Future
from dataclasses import dataclass

from .pool import mark_background

# Enough for the compiler to emit a #hal.executable.target for the CPU.
_PROBE = ("func.func @probe(%a: tensor<4xf32>) -> tensor<4xf32> {\n"
          "  %r = arith.addf %a, %a : tensor<4xf32>\n  return %r : tensor<4xf32>\n}\n")
_TARGET_ATTR = re.compile(r'cpu = "([^"]*)", cpu_features = "([^"]*)"')
_TRIPLE = re.compile(r'target_triple = "([^"]*)"')
_DESCRIPTION = re.compile(r"^[A-Za-z0-9_.+-]+$")

CPU_FLAG = "--iree-llvmcpu-target-cpu="
FEATURES_FLAG = "--iree-llvmcpu-target-cpu-features="

# Feature name prefixes shown as "vector features" (x86 and Arm).
_VECTOR_PREFIXES = ("sse", "ssse", "avx", "amx", "fma", "f16c", "neon", "sve", "sme", "dotprod", "i8mm",
                    "bf16", "fullfp16", "fp16fml")
# Bump when the stored resolution's format or meaning changes.
_STORE_VERSION = 1


@dataclass(frozen=True)
class TargetCpu:
    described: str  # what was asked for: "host", "haswell", ...
    name: str  # LLVM's CPU name, e.g. "emeraldrapids"
    features: tuple  # "+avx2" / "-avx512f", one per feature, sorted by name
    triple: str  # e.g. "x86_64-unknown-unknown-eabi-elf"

    @property
    def arch(self) -> str:
        return self.triple.split("-", 1)[0]

    @functools.cached_property
    def enabled(self) -> frozenset:
        return frozenset(f[1:] for f in self.features if f.startswith("+"))

    def has(self, feature: str) -> bool:
        return feature in self.enabled

    @property
    def features_text(self) -> str:
        return ",".join(self.features)

    def vector_features(self) -> list:
        return sorted(f for f in self.enabled if f.startswith(_VECTOR_PREFIXES))

    def flags(self) -> list:
        return [CPU_FLAG + self.name, FEATURES_FLAG + self.features_text]


def normalize_features(text: str) -> tuple:
    """The compiler's feature list as one "+name"/"-name" per feature, the last
    mention winning (for "host" LLVM lists the CPU's defaults, then what it
    detected, e.g. "+enqcmd,...,-enqcmd"). Sorted, so the same CPU always
    gives the same flag; the compiler generates the same code from it
    (checked in tests/test_target_cpu.py)."""
    state = {}
    for item in text.split(","):
        item = item.strip()
        if len(item) > 1 and item[0] in "+-":
            state[item[1:]] = item[0]
    return tuple(sign + name for name, sign in sorted(state.items()))


def enabled_features(features_text: str) -> frozenset:
    return frozenset(f[1:] for f in normalize_features(features_text) if f.startswith("+"))


def _probe(description: str) -> TargetCpu:
    """Ask the compiler which CPU `description` means (about 0.2-0.4 s)."""
    from .tool import CompilerToolError, run_compiler

    try:
        out = run_compiler(_PROBE, target_backends=["llvm-cpu"],
                                extra_args=[CPU_FLAG + description, "--compile-to=executable-sources"])
    except CompilerToolError as e:
        if e.limit:
            raise RuntimeError(f"neuron: resolving the target CPU {description!r} failed: {e.limit}") \
                from None
        text = str(e)
        known = re.search(r"List of accepted CPUs: ([^\n]*)", text)
        hint = f"; the compiler knows: {known.group(1)[:1500]}" if known else f":\n{text.strip()[:2000]}"
        raise RuntimeError(f"neuron: TORCHNEURON_TARGET_CPU={description!r} is no CPU the compiler knows{hint}") from None
    text = out.decode() if isinstance(out, bytes) else str(out)
    attr, triple = _TARGET_ATTR.search(text), _TRIPLE.search(text)
    if attr is None or triple is None:
        raise RuntimeError(f"neuron: could not read the CPU the compiler resolved {description!r} to")
    return TargetCpu(description, attr.group(1), normalize_features(attr.group(2)), triple.group(1))


def _host_identity() -> str | None:
    """What identifies this host's CPU to LLVM's detection, from /proc/cpuinfo
    (first processor); None where there is none (then nothing is stored)."""
    wanted = {"vendor_id", "cpu family", "model", "model name", "stepping", "flags", "Features",
              "CPU implementer", "CPU architecture", "CPU variant", "CPU part", "CPU revision", "isa", "uarch"}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            block = f.read().split("\n\n", 1)[0]
    except OSError:
        return None
    fields = []
    for line in block.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() in wanted:
            fields.append(f"{name.strip()}={value.strip()}")
    return "\n".join(fields) or None


# Where resolutions are kept across processes: the disk cache sets it
# (cache/disk.py, folder target/); None keeps them in this process only.
# An object with read(name) -> bytes | None and write(name, data).
store = None


def _store_name(description: str) -> str | None:
    """The name this description's resolution is kept under; None when it
    cannot be kept (no store, or a host CPU we cannot identify)."""
    import platform

    from .tool import compiler_version

    if store is None:
        return None
    # A named CPU means the same on every host of an architecture; "host" means this CPU.
    identity = _host_identity() if description == "host" else platform.machine()
    if identity is None:
        return None
    return hashlib.sha256(f"{_STORE_VERSION}\0{compiler_version()}\0{description}\0{identity}".encode()).hexdigest()


def _load(name: str, description: str) -> TargetCpu | None:
    try:
        d = json.loads(store.read(name) or b"null")
        cpu = TargetCpu(description, str(d["name"]), tuple(str(x) for x in d["features"]), str(d["triple"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not cpu.name or cpu.features != normalize_features(cpu.features_text):
        return None  # damaged: resolve again
    return cpu


def _save(name: str, cpu: TargetCpu) -> None:
    try:
        store.write(name, json.dumps({"name": cpu.name, "features": list(cpu.features), "triple": cpu.triple}).encode())
    except Exception:  # noqa: BLE001 - only an optimization: the next process resolves again
        pass


_resolved: dict = {}  # description -> TargetCpu
_resolving: dict = {}  # description -> Future of the one resolution under way
_resolving_lock = threading.Lock()


def resolve(description: str = "host") -> TargetCpu:
    """The CPU `description` means, with its features; once per process, and
    kept in the disk cache so a restart skips the compiler. A resolution
    already under way (resolve_soon) is waited for, not repeated."""
    description = description.strip() or "host"
    cpu = _resolved.get(description)
    return cpu if cpu is not None else _resolution(description).result()


def _resolution(description: str) -> Future:
    with _resolving_lock:
        future = _resolving.get(description)
        owner = future is None
        if owner:
            future = _resolving[description] = Future()
    if owner:
        try:
            cpu = _resolve(description)
        except BaseException as e:
            with _resolving_lock:  # not kept: the next call tries again and raises again
                _resolving.pop(description, None)
            future.set_exception(e)
            raise
        _resolved[description] = cpu
        future.set_result(cpu)
    return future


def _clear() -> None:
    with _resolving_lock:
        _resolved.clear()
        _resolving.clear()


resolve.cache_clear = _clear


def resolve_soon(description: str = "host") -> TargetCpu | None:
    """The resolved CPU when it is known without the compiler (this process
    resolved it, or the disk cache has it), else None while the compiler
    resolves it on a background thread (about 0.2 s a cold process's first
    ops need not wait for: they run on the host path meanwhile). A described
    CPU ("haswell") resolves here, so a wrong name is reported at once."""
    description = description.strip() or "host"
    cpu = _resolved.get(description)
    if cpu is not None:
        return cpu
    under_way = _resolving.get(description)
    if under_way is not None and not under_way.done():
        return None
    name = _store_name(description) if description == "host" else None
    if description != "host" or (name is not None and _load(name, description) is not None):
        return resolve(description)

    def run():
        mark_background()
        try:
            _resolution(description)
        except Exception:  # noqa: BLE001 - whoever needs the CPU resolves again and reports it
            pass

    threading.Thread(target=run, name="neuron-target-cpu", daemon=True).start()
    return None


def resolved(description: str = "host") -> TargetCpu | None:
    """The CPU if this process has resolved it already; never waits."""
    return _resolved.get(description.strip() or "host")


def _resolve(description: str) -> TargetCpu:
    if not _DESCRIPTION.match(description):
        raise RuntimeError(f"neuron: TORCHNEURON_TARGET_CPU={description!r} is not a CPU name")
    name = _store_name(description)
    cpu = _load(name, description) if name else None
    if cpu is None:
        cpu = _probe(description)
        if name:
            _save(name, cpu)
    return cpu


def host() -> TargetCpu:
    return resolve("host")


def configured() -> TargetCpu:
    """The CPU the configuration describes (TORCHNEURON_TARGET_CPU)."""
    from .. import config

    return resolve(config.settings.target_cpu)


def missing_on_host(cpu: TargetCpu) -> list:
    """Features `cpu` has that this host lacks (empty: its code runs here)."""
    if cpu.described == "host":
        return []
    return sorted(cpu.enabled - host().enabled)


def check_runnable(cpu: TargetCpu) -> None:
    """Refuse to run code compiled for a CPU this host cannot execute."""
    missing = missing_on_host(cpu)
    if missing:
        raise RuntimeError(
            f"neuron: TORCHNEURON_TARGET_CPU={cpu.described!r} ({cpu.name}) has features this host's CPU "
            f"({host().name}) lacks: {', '.join(missing)}. Code compiled for it could die here with an illegal "
            "instruction. Describe this CPU (the default, 'host') or an older one; a compile service may still "
            "compile for it on behalf of clients that run it."
        )


def names_host(flags) -> str | None:
    """The first flag that leaves the CPU to whichever machine compiles
    ("...target-cpu=host"), or None."""
    for flag in flags:
        if flag.startswith((CPU_FLAG, FEATURES_FLAG)) and flag.split("=", 1)[1].strip() == "host":
            return flag
    return None


def cpu_of_flags(flags) -> tuple:
    """(cpu name, feature list text) named by compile flags; None where absent."""
    name = features = None
    for flag in flags:
        if flag.startswith(CPU_FLAG):
            name = flag[len(CPU_FLAG):]
        elif flag.startswith(FEATURES_FLAG):
            features = flag[len(FEATURES_FLAG):]
    return name, features
