"""Compiling torch-dialect MLIR into an IREE executable for the configured target."""

from __future__ import annotations

import functools
import time

from .. import config
from . import target_cpu, target_vulkan
from .read_only_inputs import inputs_written_in_place, protect_inputs
from .tool import CompilerToolError, run_compiler

# IREE HAL driver -> compiler target backend.
_BACKENDS = {
    "local-task": "llvm-cpu",
    "local-sync": "llvm-cpu",
    "cuda": "cuda",
    "hip": "rocm",
    "vulkan": "vulkan-spirv",
}


class NotCompilable(Exception):
    """This call cannot take the compiled path; the reason says why (the
    lowering cannot express it, or the compiler refused it)."""


class CompileError(RuntimeError):
    """The compiler rejected an op: carries the op, its input shapes and the diagnostic."""

    def __init__(self, what: str, diagnostic: str):
        self.what = what
        self.diagnostic = diagnostic
        super().__init__(f"neuron: compiling {what} failed:\n{diagnostic.strip()[:4000]}")


# IREE records a module's command buffers once and replays them with each
# call's buffers through a binding table (iree-org/iree#17875, open). On its
# Vulkan driver the copies in them (a concatenation, a stack) kept the first
# call's buffers: the second `torch.stack` of fresh tensors wrote nothing into
# its output (lavapipe, IREE 3.13), which made a GPT's gradient clipping wrong
# from its second step. Recording per launch costs microseconds; the CPU
# drivers replay correctly and keep the binding tables.
_RECORDED_PER_LAUNCH = ("--iree-hal-indirect-command-buffers=false",)


def target_flags(driver: str | None = None, to_run: bool = True) -> tuple:
    """(backend, flags) for a driver; every flag here changes code, so all go
    in the cache key. The CPU is named explicitly (see target_cpu.py).
    `to_run`: the code will run here, so refuse a described CPU with features
    this host lacks (False only for work that compiles and never runs)."""
    driver = driver or config.settings.driver
    backend = _BACKENDS.get(driver)
    if backend is None:
        raise RuntimeError(f"neuron: no compiler target for driver {driver!r}; known: {', '.join(_BACKENDS)}")
    if backend == "vulkan-spirv":
        return backend, target_vulkan.flags() + _RECORDED_PER_LAUNCH
    if backend != "llvm-cpu":
        return backend, ("--iree-input-demote-f64-to-f32=false",) + _RECORDED_PER_LAUNCH
    cpu = target_cpu.resolve(config.settings.target_cpu)
    if to_run:
        target_cpu.check_runnable(cpu)
    return backend, cpu_flags(cpu)


def target_known(driver: str | None = None) -> bool:
    """Whether target_flags() answers now; when the compiler must first
    resolve this host's CPU (a cold cache), that starts in the background
    and this is False until it lands."""
    if _BACKENDS.get(driver or config.settings.driver) != "llvm-cpu":
        return True
    return target_cpu.resolve_soon(config.settings.target_cpu) is not None


@functools.lru_cache(maxsize=None)
def cpu_flags(cpu) -> tuple:
    """The llvm-cpu flags for a resolved CPU (target_cpu.TargetCpu)."""
    flags = ["--iree-input-demote-f64-to-f32=false", *cpu.flags(), "--iree-opt-data-tiling=true"]
    # Microkernels per CPU (measured when flags per CPU were chosen): with
    # AVX-512 they made a 1024x1024 fp32 matmul 2.3x faster (2 cores: 19.2 ms
    # without, 8.4 ms with; CPU eager 11.3 ms); on an AVX2-only CPU data
    # tiling without them was fastest. Other architectures are unmeasured and
    # keep them.
    if cpu.arch in ("x86_64", "i386", "i686") and not cpu.has("avx512f"):
        flags.append("--iree-llvmcpu-enable-ukernels=none")
    else:
        flags.append("--iree-llvmcpu-enable-ukernels=all")
    return tuple(flags)



def compile_mlir(mlir: str, what: str, driver: str | None = None, target: tuple | None = None) -> tuple:
    """Compile MLIR text for a driver, or for an explicit (backend, flags)
    target; returns (vmfb bytes, seconds). Raises CompileError."""
    backend, flags = target or target_flags(driver)
    start = time.perf_counter()
    try:
        # Two phases, as fast as one: the flow-level program shows which
        # read-only inputs IREE would update in place (read_only_inputs.py).
        flow = run_compiler(
            mlir, input_type="torch", target_backends=[backend], extra_args=[*flags, "--compile-to=flow"]
        )
        written = inputs_written_in_place(flow.decode())
        if written:
            vmfb = run_compiler(
                protect_inputs(mlir, written), input_type="torch", target_backends=[backend], extra_args=list(flags)
            )
        else:
            vmfb = run_compiler(flow, target_backends=[backend], extra_args=[*flags, "--compile-from=flow"])
    except CompilerToolError as e:
        raise CompileError(what, str(e)) from None
    return bytes(vmfb), time.perf_counter() - start
