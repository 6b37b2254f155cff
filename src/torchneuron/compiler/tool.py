"""Running the IREE compiler tool (iree-compile) as a process: its command
line, time and memory limits, lower priority from background threads, and
telling the compiler's verdict on a module from the process dying."""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess

from .. import config
from .pool import in_background, lower_priority


@functools.lru_cache(maxsize=None)
def compiler_version() -> str:
    from importlib.metadata import version

    return version("iree-base-compiler")


class CompilerToolError(RuntimeError):
    """iree-compile exited with an error: its diagnostics and command line."""

    def __init__(self, command: list, returncode: int, stderr: bytes, limit: str | None = None):
        self.command, self.returncode = command, returncode
        self.diagnostics = stderr.decode("utf-8", errors="replace")
        self.limit = limit  # which of the compiler's limits stopped it, or None
        if limit:
            self.diagnostics = f"{limit}\n{self.diagnostics}"
        super().__init__(f"Error invoking IREE compiler tool {os.path.basename(command[0])}\n"
                         f"Error code: {returncode}\nDiagnostics:\n{self.diagnostics}\n\n"
                         f"Invoked with:\n {' '.join(command)}\n\n"
                         "Need more information? Set IREE_SAVE_TEMPS=/some/dir in your environment "
                         "to save all artifacts and reproducers.\n")


@functools.lru_cache(maxsize=None)
def _tool(name: str) -> str:
    """Where an IREE compiler tool is, found as iree.compiler.tools finds it
    (IREE_TOOL_PATH first, then the wheel's own) but without importing
    iree.compiler: its package loads the MLIR Python bindings, 0.33 s mostly
    under the GIL, which a cold program's first step paid for on another
    thread (only the lowering worker process needs them)."""
    for entry in os.environ.get("IREE_TOOL_PATH", "").split(os.pathsep):
        if entry and os.access(os.path.join(entry, name), os.X_OK):
            return os.path.join(entry, name)
    spec = importlib.util.find_spec("iree.compiler")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("neuron: the IREE compiler is not installed (pip install iree-base-compiler)")
    return os.path.join(spec.submodule_search_locations[0], "_mlir_libs", name)


def _command(input_type: str = "auto", target_backends=(), extra_args=()) -> list:
    """The command line iree.compiler.compile_str builds for these options."""
    if os.environ.get("IREE_SAVE_TEMPS"):  # the library's own, with its crash reproducers
        from iree.compiler.tools.core import CompilerOptions, build_compile_command_line
        from iree.compiler.tools.debugging import TempFileSaver

        with TempFileSaver.implicit() as temps:
            return build_compile_command_line("-", temps, CompilerOptions(
                input_type=input_type, target_backends=list(target_backends), extra_args=list(extra_args)))
    command = [_tool("iree-compile"), "-", f"--iree-input-type={input_type}",
               "--iree-vm-bytecode-module-output-format=flatbuffer-binary"]
    if not any(arg.startswith("--iree-hal-target-device=") for arg in extra_args):
        # (a device target written out in full replaces the backend's defaults)
        command += [f"--iree-hal-target-backends={b}" for b in target_backends]
    if "llvm-cpu" in target_backends:
        command.append(f"--iree-llvmcpu-embedded-linker-path={_tool('iree-lld')}")
    return command + ["--mlir-print-debuginfo", "--mlir-print-op-on-diagnostic=false", *extra_args]


def run_compiler(source, **options) -> bytes:
    """iree-compile on `source` (compile_str's input_type, target_backends
    and extra_args); from a background thread the compiler process runs at a
    lower priority. Raises CompilerToolError."""
    command = _command(**options)
    data = source.encode() if isinstance(source, str) else bytes(source)
    timeout = config.settings.compile_timeout_s or None
    memory_mb = config.settings.compile_memory_mb
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if memory_mb > 0:
        _limit_memory(process.pid, memory_mb)
    if in_background():
        lower_priority(process.pid)
    try:
        out, err = process.communicate(data, timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        _, err = process.communicate()
        raise CompilerToolError(command, process.returncode, err, limit=(
            f"the compiler ran past its time limit of {timeout:g} s and was stopped "
            "(TORCHNEURON_COMPILE_TIMEOUT)")) from None
    if process.returncode != 0:
        limit = None
        if memory_mb > 0 and _out_of_memory(process.returncode, err):
            limit = (f"the compiler ran out of its memory limit of {memory_mb} MiB "
                     "(TORCHNEURON_COMPILE_MEMORY_MB)")
        raise CompilerToolError(command, process.returncode, err, limit=limit)
    return out


def _limit_memory(pid: int, megabytes: int) -> None:
    """Cap a compiler process's data memory (heap and private mappings) once
    it has started: set from here rather than in the child before exec,
    which is unsafe in a process with threads. The compiler's first
    allocations are small, so the moment between is harmless."""
    import resource

    try:
        limit = megabytes << 20
        resource.prlimit(pid, resource.RLIMIT_DATA, (limit, limit))
    except (OSError, ValueError, AttributeError):
        pass  # the process already ended, or the platform has no prlimit


# What the compiler prints when an allocation fails: LLVM's, IREE's runtime's
# (its constant evaluation), and thread creation's.
_OUT_OF_MEMORY = ("out of memory", "RESOURCE_EXHAUSTED", "std::bad_alloc", "pthread_create failed",
                  "thread creation failed")


_LIMIT_SETTINGS = ("TORCHNEURON_COMPILE_TIMEOUT", "TORCHNEURON_COMPILE_MEMORY_MB")


def says_nothing_about_the_module(reason: str) -> bool:
    """Whether a compile failure (its message) is the compiler's process
    ending abnormally (killed by a signal, out of memory or disk) or stopped
    by a limit of this machine, not the compiler's verdict on the module:
    such failures are not remembered for other processes."""
    return "Error code: -" in reason or any(name in reason for name in _LIMIT_SETTINGS)


def _out_of_memory(returncode: int, stderr: bytes) -> bool:
    text = stderr.decode("utf-8", errors="replace")
    return returncode == -9 or any(marker in text for marker in _OUT_OF_MEMORY)
