"""Softmax and log_softmax over the last dimension, their rows in groups:
rows x columns is computed as (rows / g) x g x columns, g the largest power of
two up to 8 that divides the rows; an odd count of rows is computed as groups
of 8 and a tile of the rows left over.

IREE's llvm-cpu codegen hands a softmax's rows to workgroups in tiles of the
largest divisor of the row count up to 32, and vectorizes 8 rows at a time;
where that divisor is not a multiple of 8 (3000 rows: 30) the rows left over
run as scalar code: float32 [3000, 2992] took 976 ms, against 13.4 ms as
[375, 8, 2992] (CPU eager: 24 ms). A dimension of g rows is tiled whole.
YOLOS's attention in the census (65940 rows of 16485) did not finish."""

from __future__ import annotations

import math

import torch

ROWS = 8


def rows_in_groups(decomposition):
    """Wrap an (x, dim, half_to_float) decomposition of _softmax or _log_softmax."""

    def decompose(x, dim, half_to_float):
        shape = tuple(x.shape)
        if not shape or dim % len(shape) != len(shape) - 1 or not all(isinstance(n, int) for n in shape):
            return decomposition(x, dim, half_to_float)  # other dimensions, or symbolic sizes
        columns, rows = shape[-1], math.prod(shape[:-1])
        if rows <= ROWS or columns == 0:
            return decomposition(x, dim, half_to_float)  # one tile
        group = rows & -rows  # the largest power of two dividing the rows
        if group >= 2:  # a reshape: no copy
            group = min(group, ROWS)
            grouped = torch.ops.aten.reshape.default(x, [rows // group, group, columns])
            return torch.ops.aten.reshape.default(decomposition(grouped, 2, half_to_float), list(shape))
        # An odd count: the last rows % 8 rows are a tile of their own (IREE
        # copies the input and the result once: still 11x faster than scalar).
        flat = torch.ops.aten.reshape.default(x, [rows, columns])
        whole = rows - rows % ROWS
        grouped = torch.ops.aten.reshape.default(
            torch.ops.aten.slice.Tensor(flat, 0, 0, whole), [whole // ROWS, ROWS, columns])
        head = torch.ops.aten.reshape.default(decomposition(grouped, 2, half_to_float), [whole, columns])
        tail = decomposition(torch.ops.aten.slice.Tensor(flat, 0, whole, rows), 1, half_to_float)
        return torch.ops.aten.reshape.default(torch.ops.aten.cat.default([head, tail]), list(shape))

    return decompose
