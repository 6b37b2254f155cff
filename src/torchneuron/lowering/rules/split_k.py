"""Long matrix products in blocks of their inner dimension (split-K).

IREE's llvm-cpu matmul accumulates each result element over the whole inner
dimension K in order, so its float32 rounding error grows with K: a
[16, 8192] @ [8192, 32] product was 5.9e-4 off float64, CPU 1.1e-4, and the
census's registry held 13 such products (K 3145-12288) 5-9x further off than
CPU. Here a product with K > LONG_K is computed as a batch of products over
blocks of the inner dimension, then the blocks' results are summed: the error
grows with the block plus the number of blocks (blocks of 256: as close as
CPU's). The blocks' partial results take S x M x N floats: blocks grow past
256 where they would pass PARTIALS elements, and a product is left whole where
that leaves fewer than FEWEST blocks (a [1024, 4096] @ [4096, 1024] product in
8 blocks took 15% longer). Float32 and float64 only.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten

LONG_K = 1024
BLOCK_K = 256
PARTIALS = 1 << 21  # elements (8 MiB of float32)
FEWEST = 4  # fewer blocks gain too little accuracy for their partial results' traffic


def _blocks(k: int, rows: int) -> int:
    """Number of blocks to split an inner dimension of k into, `rows` the
    elements of one block's result (M x N, times the batch). A count that
    divides k where one is near: blocks with rows of k left over are slices
    that a batched product copies (a [4, 16, 3145] @ [4, 3145, 3145] bmm in
    10 blocks took 155 ms, K = 3200 in 10 blocks 95 ms, whole 72-88 ms)."""
    count = max(1, min(k // BLOCK_K, PARTIALS // max(1, rows)))
    for fewer in range(count, max(FEWEST, count // 2) - 1, -1):
        if k % fewer == 0:
            return fewer
    return count


def _static(*tensors) -> bool:
    return all(isinstance(n, int) for t in tensors for n in t.shape)


def _splits(a, b) -> bool:
    return (a.dtype in (torch.float32, torch.float64) and b.dtype == a.dtype and _static(a, b)
            and a.shape[-1] > LONG_K)


def mm(a, b):
    if not _splits(a, b):
        return NotImplemented
    (m, k), n = a.shape, b.shape[1]
    return _blocked(aten.reshape.default(a, [1, m, k]), aten.reshape.default(b, [1, k, n]), _blocks(k, m * n), matrix=True)


def bmm(a, b):
    if not _splits(a, b):
        return NotImplemented
    (batch, m, k), n = a.shape, b.shape[2]
    return _blocked(a, b, _blocks(k, batch * m * n))


def _blocked(a, b, count: int, matrix: bool = False):
    """a @ b for [batch, m, k] @ [batch, k, n] as `count` blocks of k in one
    batched product, summed, plus the rows of k left over (padding k to
    whole blocks would copy both operands: a [4, 3145, 3145] one made a bmm
    1.6x slower). `matrix`: return [m, n] (mm's operands came as a batch of 1)."""
    if count < FEWEST:
        return NotImplemented
    (batch, m, k), n = a.shape, b.shape[2]
    size = k // count
    whole = size * count
    head_a = aten.slice.Tensor(a, 2, 0, whole) if whole < k else a
    head_b = aten.slice.Tensor(b, 1, 0, whole) if whole < k else b
    left = aten.reshape.default(
        aten.permute.default(aten.reshape.default(head_a, [batch, m, count, size]), [0, 2, 1, 3]),
        [batch * count, m, size])
    right = aten.reshape.default(head_b, [batch * count, size, n])
    partial = aten.reshape.default(aten.bmm.default(left, right), [batch, count, m, n])
    total = aten.sum.dim_IntList(partial, [1], False)
    if whole < k:
        total = aten.add.Tensor(total, aten.bmm.default(aten.slice.Tensor(a, 2, whole, k),
                                                        aten.slice.Tensor(b, 1, whole, k)))
    return aten.reshape.default(total, [m, n]) if matrix else total


def rules() -> dict:
    return {aten.mm.default: mm, aten.bmm.default: bmm}

