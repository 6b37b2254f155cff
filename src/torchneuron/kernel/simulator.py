"""The simulator: the kernel's own Python on NumPy tiles, the oracle the
compiled kernels are tested against.

Arguments are NumPy arrays (CPU tensors are viewed as NumPy, written back
at the end), tiles are NumPy arrays, so `breakpoint()` and `print` inside a
kernel show real values. affine_range runs its iterations in a shuffled
order; a new tile (`nk.ndarray`) starts as NaN, so reading one before
writing it shows. matmul accumulates in float32; bfloat16 tiles are held in
float32 (NumPy has no bfloat16). The kernel is traced first (jit.py), so
the simulator enforces the same rules, at the same lines, as the compiler.
"""

from __future__ import annotations

import random

import numpy as np

from .language import KernelError, running

_NUMPY = {"float32": np.float32, "float16": np.float16, "bfloat16": np.float32, "int32": np.int32, "bool": np.bool_}


class Simulator:
    def __init__(self, grid: tuple, seed: int = 0):
        self.grid = grid
        self.ids: tuple = ()
        self.shuffle = random.Random(seed)

    def program_id(self, axis):
        if not isinstance(axis, int) or not 0 <= axis < len(self.ids):
            raise KernelError(f"program_id({axis!r}): the grid has {len(self.ids)} axes")
        return self.ids[axis]

    def loop(self, n, kind):
        order = list(range(n))
        if kind == "affine":
            self.shuffle.shuffle(order)
        return iter(order)

    def load(self, view):
        tile = np.array(view, copy=True)
        return tile

    def store(self, view, tile):
        tile = np.asarray(tile)
        if tile.shape != view.shape and tile.size != 1:
            tile = np.broadcast_to(tile, view.shape)
        view[...] = tile

    def full(self, shape, value, dtype):
        if value is None:
            return np.full(shape, np.nan if dtype in ("float32", "float16", "bfloat16") else 0, dtype=_NUMPY[dtype])
        return np.full(shape, value, dtype=_NUMPY[dtype])

    def arange(self, n, dtype):
        return np.arange(n, dtype=_NUMPY[dtype])

    def unary(self, name, x):
        x = np.asarray(x)
        if name == "rsqrt":
            return (1 / np.sqrt(x)).astype(x.dtype)
        if name == "sigmoid":
            return (1 / (1 + np.exp(-x))).astype(x.dtype)
        if name == "negative":
            return -x
        return getattr(np, name)(x)

    def binary(self, name, x, y):
        return getattr(np, name)(x, y)

    def where(self, condition, x, y):
        out = np.where(condition, x, y)
        dtype = next((np.asarray(v).dtype for v in (x, y) if isinstance(v, np.ndarray)), out.dtype)
        return out.astype(dtype)

    def cast(self, x, dtype):
        return np.asarray(x).astype(_NUMPY[dtype])

    def reduce(self, name, x, axis, keepdims):
        return getattr(np, name)(x, axis=axis, keepdims=keepdims)

    def matmul(self, a, b):
        return np.asarray(a, dtype=np.float32) @ np.asarray(b, dtype=np.float32)

    def transpose(self, x):
        return np.ascontiguousarray(np.asarray(x).T)

    def device_print(self, label, x):
        print(label, x)

    def run(self, fn, args, constants):
        with running(self):
            for ids in np.ndindex(*self.grid):
                self.ids = tuple(int(i) for i in ids)
                fn(*args, **constants)



__all__ = ["Simulator"]
