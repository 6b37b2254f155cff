"""@nk.jit kernels: traced once per (grid, argument shapes and dtypes,
constants), compiled through the project's compiler and every cache layer,
launched on the device's queue like any executable; and nk.simulate.

Arguments: tensors become the kernel's memory (read, or written with
nk.store, in place); anything else is a compile-time constant.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import math
import threading

import numpy as np
import torch

from .language import KernelError, running
from .simulator import Simulator
from .tracer import Index, Ref, Tracer

_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16", torch.int32: "int32",
           torch.bool: "bool"}
_PROGRAMS = 64  # programs traced apart per launch (more: the grid launches in chunks, or loops)

_NUMPY_DTYPES = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16", np.dtype(np.int32): "int32",
                 np.dtype(np.bool_): "bool"}


def jit(fn=None):
    """@nk.jit: a kernel, launched as kernel[grid](*args, **constants)."""
    if fn is None:
        return jit
    return Kernel(fn)


class Kernel:
    def __init__(self, fn):
        self.fn = fn
        self.signature = inspect.signature(fn)
        self._compiled: dict = {}
        self._lock = threading.Lock()
        self.launches = 0  # on neuron tensors, in this process
        functools.update_wrapper(self, fn)

    def __getitem__(self, grid):
        grid = _grid(grid)
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def __call__(self, *args, **kwargs):
        raise KernelError(f"launch kernel {self.fn.__name__} over a grid: {self.fn.__name__}[grid](...)")

    # -- tracing -----------------------------------------------------------------

    def bind(self, args, kwargs) -> dict:
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise KernelError(f"kernel {self.fn.__name__}: {e}") from None
        bound.apply_defaults()
        return dict(bound.arguments)

    def trace(self, grid, arguments: dict) -> Tracer:
        """Run the kernel on proxies: every rule is checked here."""
        tracer = Tracer(self.fn.__code__)
        call = {}
        for position, (name, value) in enumerate(arguments.items()):
            spec = _spec(value)
            if spec is None:
                call[name] = value
                continue
            shape, dtype = spec
            if not shape:
                raise KernelError(f"kernel {self.fn.__name__}: argument `{name}` is a 0-dim tensor; pass a 1-element one")
            ref = Ref(tracer, position, name, shape, dtype)
            tracer.refs.append(ref)
            call[name] = ref
        with running(tracer):
            chunk = _chunk(grid)
            if chunk:
                self._trace_programs(tracer, grid, chunk, arguments, call)
                return tracer
            loops = []
            for n in grid:
                loop = tracer.loop(n, "grid")
                index = next(loop)
                tracer.program_ids.append(next(iter(index.terms)))
                loops.append(loop)
            self.fn(**call)
            for loop in reversed(loops):
                next(loop, None)
        return tracer

    def _trace_programs(self, tracer, grid, chunk, arguments, call):
        """The grid program by program: a loop over program ids would carry
        whole outputs from one program to the next, and IREE copies a
        carried tensor at every iteration; traced apart, each store lands in
        place and the programs' dispatches may run concurrently. A grid of
        more than _PROGRAMS programs launches in chunks of the first axis:
        the chunk's number is a runtime argument, so one executable serves
        every chunk."""
        rest = [range(n) for n in grid[1:]]
        if chunk == grid[0]:
            for ids in itertools.product(range(chunk), *rest):
                tracer.program_ids = list(ids)
                tracer.objects = []  # a program's tiles end with it: later loops need not consider them
                self.fn(**call)
            return
        number = Ref(tracer, len(arguments), "(grid chunk)", (1,), "int32")
        tracer.refs.append(number)
        zero, value, var = tracer.fresh("c"), tracer.fresh(), tracer.fresh("i")
        tracer.emit(f"{zero} = arith.constant 0 : index")
        tracer.emit(f"{value} = tensor.extract {number.ssa}[{zero}] : tensor<1xi32>")
        tracer.emit(f"{var} = arith.index_cast {value} : i32 to index")
        tracer.trips[var] = grid[0] // chunk
        for ids in itertools.product(range(chunk), *rest):
            tracer.program_ids = [Index({var: chunk}, ids[0]), *ids[1:]]
            tracer.objects = []
            self.fn(**call)

    # -- launching ------------------------------------------------------------------

    def launch(self, grid, args, kwargs):
        arguments = self.bind(args, kwargs)
        tensors = [(name, v) for name, v in arguments.items() if isinstance(v, torch.Tensor)]
        devices = {v.device for _, v in tensors}
        if any(d.type != "neuron" for d in devices) or len(devices) > 1:
            where = ", ".join(f"{n} on {v.device}" for n, v in tensors)
            raise KernelError(f"kernel {self.fn.__name__} takes tensors on one neuron device (got {where}); "
                              f"run it on CPU tensors with nk.simulate({self.fn.__name__})[grid](...)")
        compiled = self.compiled_for(grid, arguments)
        _launch(compiled, [v for _, v in tensors], self.fn.__name__)
        self.launches += 1

    def compiled_for(self, grid, arguments):
        key = (grid,) + tuple(
            (name, tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else (name, type(v).__name__, repr(v))
            for name, v in arguments.items())
        with self._lock:
            found = self._compiled.get(key)
        if found is not None:
            return found
        from ..cache import executables
        from ..compiler import NotCompilable, target_flags

        tracer = self.trace(grid, arguments)
        backend, flags = target_flags()
        try:
            executable = executables.executable_for(tracer.module(), f"kernel {self.fn.__name__}", (backend, tuple(flags)))
        except NotCompilable as e:  # the kernel passed every rule: what failed is the lowering's
            code = self.fn.__code__
            raise KernelError(
                f"{code.co_filename}:{code.co_firstlineno}: kernel {self.fn.__name__} did not compile for "
                f"{backend} ({_first_error(str(e))}). It passed the language's rules, so this is a gap in "
                f"torchneuron's kernel lowering: nk.simulate runs it meanwhile; {self.fn.__name__}.mlir(...) "
                f"shows what was generated") from None
        chunk = _chunk(grid)
        compiled = (executable, tuple(ref.written for ref in tracer.refs), grid[0] // chunk if chunk else 1)
        with self._lock:
            self._compiled[key] = compiled
        return compiled

    def mlir(self, grid, *args, **kwargs) -> str:
        """The MLIR the kernel traces to for these arguments (tensors or
        NumPy arrays give shapes and dtypes)."""
        return self.trace(_grid(grid), self.bind(args, kwargs)).module()


def _launch(compiled, tensors, name) -> None:
    from ..runtime import device_queue
    from ..runtime.queue import queue_recorded

    executable, written, chunks = compiled
    index = tensors[0].device.index or 0
    queue = device_queue(index)
    queue_recorded(index, f"kernel {name}")  # what adaptive eager recorded runs first
    keep, write_back = [], []
    for t, w in zip(tensors, written):
        if not t.is_contiguous():
            c = t.contiguous()
            if w:
                write_back.append((t, c))
            t = c
        keep.append(t)
    lane = queue.lane_for(max(t.numel() for t in keep))
    bound = [lane.import_memory(t, t.storage_offset() * t.dtype.itemsize, tuple(t.shape), t.dtype) for t in keep]
    if chunks == 1:
        queue.launch(executable, bound, keep, f"kernel {name}", None, lane)
    for c in range(chunks if chunks > 1 else 0):  # one launch per chunk of the grid, its number an argument
        number = _chunk_number(index, c)
        queue.launch(executable, bound + [lane.import_memory(number, 0, (1,), torch.int32)], keep + [number],
                     f"kernel {name}", None, lane)
    for original, c in write_back:
        original.copy_(c)
    for t, w in zip(tensors, written):
        if w:
            torch.autograd.graph.increment_version(t)


def _first_error(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    found = next((ln[ln.index("error:"):] for ln in lines if "error:" in ln), lines[0] if lines else "unknown")
    return found[:300]


def _chunk(grid) -> int:
    """Programs of the first axis traced apart and launched together (the
    whole grid when it is small enough); 0: the grid runs as a loop."""
    if math.prod(grid) <= _PROGRAMS:
        return grid[0]
    rest = math.prod(grid[1:])
    fitting = [d for d in range(1, grid[0] + 1) if grid[0] % d == 0 and d * rest <= _PROGRAMS]
    return max(fitting) if fitting and max(fitting) * rest * 4 >= _PROGRAMS else 0


_numbers: dict = {}


def _chunk_number(index: int, c: int) -> torch.Tensor:
    """A device tensor holding `c`, kept for later launches."""
    key = (index, c)
    number = _numbers.get(key)
    if number is None:
        number = _numbers[key] = torch.tensor([c], dtype=torch.int32).to(torch.device("neuron", index))
    return number


def _spec(value):
    """(shape, dtype) of a tensor-like argument; None for a constant."""
    if isinstance(value, torch.Tensor):
        if value.dtype not in _DTYPES:
            raise KernelError(f"kernel arguments of dtype {value.dtype} are not supported; use one of "
                              f"{', '.join(map(str, _DTYPES))}")
        return tuple(value.shape), _DTYPES[value.dtype]
    if isinstance(value, np.ndarray):
        if value.dtype not in _NUMPY_DTYPES:
            raise KernelError(f"kernel arguments of dtype {value.dtype} are not supported")
        return tuple(value.shape), _NUMPY_DTYPES[value.dtype]
    return None


def _grid(grid) -> tuple:
    grid = (grid,) if isinstance(grid, int) else tuple(grid)
    if not grid or any(not isinstance(n, int) or n <= 0 for n in grid):
        raise KernelError(f"a grid is one or more positive ints, got {grid!r}")
    return grid


class simulate:  # noqa: N801 - nk.simulate(kernel)[grid](...)
    """Run a kernel on NumPy arrays or CPU tensors, in Python: the oracle.
    The kernel is traced first, so its rules are checked as when compiled."""

    def __init__(self, kernel, seed: int = 0):
        if not isinstance(kernel, Kernel):
            raise KernelError("nk.simulate takes an @nk.jit kernel")
        self.kernel, self.seed = kernel, seed

    def __getitem__(self, grid):
        grid = _grid(grid)
        return lambda *args, **kwargs: self.run(grid, args, kwargs)

    def run(self, grid, args, kwargs):
        arguments = self.kernel.bind(args, kwargs)
        self.kernel.trace(grid, arguments)
        values, write_back = {}, []
        for name, v in arguments.items():
            if isinstance(v, torch.Tensor):
                if v.device.type != "cpu":
                    raise KernelError(f"nk.simulate takes NumPy arrays or CPU tensors; `{name}` is on {v.device}")
                if v.dtype == torch.bfloat16:
                    array = v.float().numpy()
                    write_back.append((v, array))
                else:
                    array = v.detach().numpy()
                values[name] = array
            else:
                values[name] = v
        Simulator(grid, self.seed).run(self.kernel.fn, [], values)
        for tensor, array in write_back:
            tensor.copy_(torch.from_numpy(array))


__all__ = ["Kernel", "jit", "simulate"]
