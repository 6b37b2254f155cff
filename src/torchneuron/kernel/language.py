"""The kernel language's surface (`import torchneuron.kernel as nk`).

Every function here works in both interpreters of a kernel: the tracer,
which records the kernel once per (shapes, dtypes, constants) and emits MLIR
(tracer.py), and the simulator, which runs the same Python on NumPy tiles
(simulator.py). The active one is set for the duration of a kernel call;
outside a kernel these functions raise.

Surface version 1 (see docs/kernels.md): changes that alter what an existing
kernel computes get a new version, never a silent change.
"""

from __future__ import annotations

import threading

import numpy as np

VERSION = 1
PMAX = 128  # the partition dimension (a tile's first) holds at most this many rows

float32, float16, bfloat16, int32, bool_ = "float32", "float16", "bfloat16", "int32", "bool"
DTYPES = (float32, float16, bfloat16, int32, bool_)


class KernelError(Exception):
    """A kernel broke a rule of the language; the message names its line."""


class constexpr:  # noqa: N801 - Triton's spelling, used as an annotation
    """Annotation of a compile-time constant parameter: its value is part of
    the compiled kernel's identity."""


_state = threading.local()


def active():
    interpreter = getattr(_state, "interpreter", None)
    if interpreter is None:
        raise KernelError("nk functions can only be called inside a kernel launched as kernel[grid](...) "
                          "or nk.simulate(kernel)[grid](...)")
    return interpreter


class running:
    """Context: `interpreter` runs the kernel's nk calls."""

    def __init__(self, interpreter):
        self.interpreter = interpreter

    def __enter__(self):
        self.saved = getattr(_state, "interpreter", None)
        _state.interpreter = self.interpreter
        return self.interpreter

    def __exit__(self, *exc):
        _state.interpreter = self.saved


# -- programs and loops --------------------------------------------------------

def program_id(axis: int):
    """This instance's index along grid axis `axis`."""
    return active().program_id(axis)


def affine_range(n: int):
    """A loop whose iterations are independent (no value carried from one to
    the next; stores to disjoint parts of an output are fine). The simulator
    runs them in a shuffled order."""
    return active().loop(_trip_count(n), "affine")


def sequential_range(n: int):
    """A loop whose iterations run in order and may carry values (an
    accumulator updated with `acc[...] = ...` or `acc += ...`)."""
    return active().loop(_trip_count(n), "sequential")


def static_range(n: int):
    """A loop unrolled when the kernel is traced (Python's range)."""
    if not isinstance(n, (int, np.integer)):
        raise KernelError(f"static_range's trip count must be an int known when the kernel is traced, got {n!r}")
    return range(_trip_count(n))


def _trip_count(n):
    if hasattr(n, "bounds"):  # a program id or loop index (traced): sequential_range(qi + 1)
        return n
    if not isinstance(n, (int, np.integer)) or n < 0:
        raise KernelError(f"a loop's trip count must be a non-negative int, or depend on program ids and loop "
                          f"indices only, got {n!r}")
    return int(n)


def ds(start, size: int):
    """A slice of `size` elements from `start` (which may depend on
    program_id or a loop index): t[nk.ds(i * 64, 64)]."""
    return slice(start, start + size)


# -- memory ---------------------------------------------------------------------

def load(view):
    """The tile at `view` (a kernel argument sliced: x[i * 128:(i + 1) * 128, :])."""
    return active().load(view)


def store(view, tile) -> None:
    """Write `tile` to `view` (an argument sliced); shapes and dtypes must match."""
    active().store(view, tile)


def ndarray(shape, dtype=float32, buffer=None):
    """A new tile (contents undefined until written: write before reading).
    `buffer` is accepted for NKI compatibility (every tile lives on chip)."""
    return active().full(_shape(shape), None, _dtype(dtype))


def zeros(shape, dtype=float32):
    return active().full(_shape(shape), 0, _dtype(dtype))


def full(shape, value, dtype=float32):
    return active().full(_shape(shape), value, _dtype(dtype))


def arange(n: int, dtype=int32):
    """The tile [0, 1, ..., n - 1]: positions, for masks (add a program id
    or loop index times the block size for global positions)."""
    return active().arange(_shape(n)[0], _dtype(dtype))


def _shape(shape) -> tuple:
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if not shape or any(not isinstance(s, (int, np.integer)) or s <= 0 for s in shape):
        raise KernelError(f"a tile's shape must be positive ints known when the kernel is traced, got {shape!r}")
    if len(shape) >= 2 and shape[0] > PMAX:
        raise KernelError(f"a tile's first (partition) dimension holds at most {PMAX} rows, got shape {shape}")
    return tuple(int(s) for s in shape)


def _dtype(dtype) -> str:
    if dtype is bool:
        return bool_
    name = getattr(dtype, "__name__", None) if not isinstance(dtype, str) else dtype
    name = str(dtype).replace("torch.", "") if name is None else name
    if name == "bool":
        return bool_
    if name not in DTYPES:
        raise KernelError(f"unsupported tile dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    return name


# -- tile math ------------------------------------------------------------------

def _unary(name):
    def fn(x):
        return active().unary(name, x)
    fn.__name__ = name
    fn.__doc__ = f"Elementwise {name}."
    return fn


exp, log, tanh, sqrt, rsqrt, abs, sigmoid, negative = (  # noqa: A001 - NKI's names
    _unary(n) for n in ("exp", "log", "tanh", "sqrt", "rsqrt", "abs", "sigmoid", "negative"))


def maximum(x, y):
    return active().binary("maximum", x, y)


def minimum(x, y):
    return active().binary("minimum", x, y)


def where(condition, x, y):
    """x where `condition` (a bool tile) holds, else y."""
    return active().where(condition, x, y)


def sum(x, axis: int, keepdims: bool = False):  # noqa: A001
    return active().reduce("sum", x, axis, keepdims)


def max(x, axis: int, keepdims: bool = False):  # noqa: A001
    return active().reduce("max", x, axis, keepdims)


def min(x, axis: int, keepdims: bool = False):  # noqa: A001
    return active().reduce("min", x, axis, keepdims)


def matmul(a, b):
    """a @ b for 2-D tiles, accumulated and returned in float32."""
    return active().matmul(a, b)


def transpose(x):
    """A 2-D tile's transpose."""
    return active().transpose(x)


def cast(x, dtype):
    return active().cast(x, _dtype(dtype))


def device_print(label: str, x) -> None:
    """Print a tile in the simulator; compiled kernels print nothing."""
    active().device_print(label, x)


__all__ = [
    "DTYPES", "PMAX", "VERSION", "KernelError", "abs", "affine_range", "arange", "bfloat16", "bool_", "cast", "constexpr",
    "device_print", "ds", "exp", "float16", "float32", "full", "int32", "load", "log", "matmul", "max",
    "maximum", "min", "minimum", "ndarray", "negative", "program_id", "rsqrt", "sequential_range",
    "sigmoid", "sqrt", "static_range", "store", "sum", "tanh", "transpose", "where", "zeros",
]
