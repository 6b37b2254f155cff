"""Dense factorizations and solves (LU with partial pivoting, Cholesky,
triangular solves and what is built on them) as unrolled graphs of
elementwise ops, so they compile: IREE has no LAPACK.

Matrix sizes are static, so each step of the algorithm is a few whole-matrix
ops selected by row/column masks; the graph grows with n, so matrices beyond
MAX_N stay on the host fallback. The algorithms are LAPACK's unblocked ones
(getf2, potf2, trsm) with its conventions: 1-based int32 pivots, the first
maximal |pivot| in a column, info = index of the first zero pivot.
"""

from __future__ import annotations

import torch

from ..call import NotCompilable

aten = torch.ops.aten
MAX_N = 32


def _check(A, *others):
    if A.dim() < 2 or A.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise NotCompilable("linear algebra on this dtype or rank")
    if max(A.shape[-2:]) > MAX_N:
        raise NotCompilable(f"matrices larger than {MAX_N} (the unrolled graph grows with n)")
    for t in others:
        if t.dtype != A.dtype:
            raise NotCompilable("mixed dtypes")


def _index(n, device):
    return torch.arange(n, device=device)


def _row(M, i):
    return M[..., i, :]


def _set_row(M, i, value):
    rows = _index(M.shape[-2], M.device).unsqueeze(-1)
    return torch.where(rows == i, value.unsqueeze(-2), M)


def _pick_row(M, p):
    """Row p[...] of each matrix (p a batch of indices): exact, with no 0*inf."""
    rows = _index(M.shape[-2], M.device).unsqueeze(-1)
    hit = rows == p.unsqueeze(-1).unsqueeze(-1)
    return torch.where(hit, M, torch.zeros_like(M)).sum(-2)


def _swap_rows(M, k, p):
    rows = _index(M.shape[-2], M.device).unsqueeze(-1)
    row_k, row_p = _row(M, k), _pick_row(M, p)
    swapped = torch.where(rows == k, row_p.unsqueeze(-2), M)
    return torch.where(rows == p.unsqueeze(-1).unsqueeze(-1), row_k.unsqueeze(-2), swapped)


def lu_factor(A):
    """(LU, pivots (1-based int32), info) as LAPACK getrf returns them."""
    m, n = A.shape[-2:]
    LU = A.clone()
    rows = _index(m, A.device).unsqueeze(-1)
    cols = _index(n, A.device)
    pivots = []
    info = torch.zeros(A.shape[:-2], dtype=torch.int32, device=A.device)
    for k in range(min(m, n)):
        column = torch.abs(LU[..., k:, k])
        p = torch.argmax(column, -1) + k
        pivots.append(p)
        LU = _swap_rows(LU, k, p)
        pivot = LU[..., k, k]
        zero = pivot == 0
        info = torch.where(zero & (info == 0), torch.full_like(info, k + 1), info)
        safe = torch.where(zero, torch.ones_like(pivot), pivot)
        below = (rows > k) & (cols == k)
        LU = torch.where(below, LU / safe.unsqueeze(-1).unsqueeze(-1), LU)
        multipliers = LU[..., :, k].unsqueeze(-1)
        urow = LU[..., k, :].unsqueeze(-2)
        trailing = (rows > k) & (cols > k)
        LU = torch.where(trailing, LU - multipliers * urow, LU)
    if pivots:
        piv = (torch.stack(pivots, -1) + 1).to(torch.int32)
    else:
        piv = torch.zeros((*A.shape[:-2], 0), dtype=torch.int32, device=A.device)
    return LU, piv, info


def _apply_pivots(B, pivots):
    for k in range(pivots.shape[-1]):
        B = _swap_rows(B, k, pivots[..., k].to(torch.int64) - 1)
    return B


def _triangular_solve(T, B, upper, unit=False):
    """Solve T X = B for triangular T ([..., n, n]) and B ([..., n, k])."""
    n = T.shape[-1]
    X = torch.zeros_like(B)
    order = range(n - 1, -1, -1) if upper else range(n)
    for i in order:
        coeff = T[..., i, :].unsqueeze(-1)  # [..., n, 1]
        known = (_index(n, T.device) > i) if upper else (_index(n, T.device) < i)
        partial = torch.where(known.unsqueeze(-1), coeff * X, torch.zeros_like(X)).sum(-2)
        xi = B[..., i, :] - partial
        if not unit:
            xi = xi / T[..., i, i].unsqueeze(-1)
        X = _set_row(X, i, xi)
    return X


def _lu_solve(LU, pivots, B):
    n = LU.shape[-1]
    L = torch.tril(LU, -1) + torch.eye(n, dtype=LU.dtype, device=LU.device)
    U = torch.triu(LU)
    Y = _triangular_solve(L, _apply_pivots(B, pivots), upper=False, unit=True)
    return _triangular_solve(U, Y, upper=True)


def _square(A):
    if A.shape[-1] != A.shape[-2]:
        raise NotCompilable("a non-square matrix")


# -- the ops ---------------------------------------------------------------------


def linalg_lu_factor_ex(A, *, pivot=True, check_errors=False):
    _check(A)
    if not pivot or check_errors:
        raise NotCompilable("lu_factor without pivoting or with check_errors")
    return lu_factor(A)


def linalg_inv_ex(A, *, check_errors=False):
    _check(A)
    _square(A)
    if check_errors:
        raise NotCompilable("inv with check_errors (raises on the host)")
    LU, piv, info = lu_factor(A)
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device).expand(A.shape)
    return _lu_solve(LU, piv, eye), info


def linalg_solve_ex(A, B, *, left=True, check_errors=False):
    _check(A, B)
    _square(A)
    if not left or check_errors:
        raise NotCompilable("solve with left=False or check_errors")
    vector = B.dim() == 1 or (B.dim() == A.dim() - 1 and B.shape == A.shape[:-1])
    Bm = B.unsqueeze(-1) if vector else B
    batch = torch.broadcast_shapes(A.shape[:-2], Bm.shape[:-2])
    LU, piv, info = lu_factor(A)
    X = _lu_solve(LU.expand(*batch, *LU.shape[-2:]), piv.expand(*batch, piv.shape[-1]),
                  Bm.expand(*batch, *Bm.shape[-2:]))
    return (X.squeeze(-1) if vector else X), LU, piv, info


def linalg_lu_solve(LU, pivots, B, *, left=True, adjoint=False):
    _check(LU, B)
    if not left or adjoint:
        raise NotCompilable("lu_solve with left=False or adjoint")
    batch = torch.broadcast_shapes(LU.shape[:-2], B.shape[:-2])
    return _lu_solve(LU.expand(*batch, *LU.shape[-2:]), pivots.expand(*batch, pivots.shape[-1]),
                     B.expand(*batch, *B.shape[-2:]))


def _permutation_sign(pivots):
    n = pivots.shape[-1]
    swaps = (pivots.to(torch.int64) - 1 != _index(n, pivots.device)).sum(-1)
    return 1.0 - 2.0 * torch.remainder(swaps, 2)


def linalg_det(A):
    _check(A)
    _square(A)
    # PyTorch factors A^T here (the auxiliary LU it returns for backward).
    LU, piv, _ = lu_factor(A.transpose(-2, -1))
    diag = torch.diagonal(LU, 0, -2, -1)
    det = diag.prod(-1) * _permutation_sign(piv).to(A.dtype)
    return det, LU, piv


def linalg_slogdet(A):
    _check(A)
    _square(A)
    LU, piv, _ = lu_factor(A.transpose(-2, -1))
    diag = torch.diagonal(LU, 0, -2, -1)
    sign = torch.sign(diag).prod(-1) * _permutation_sign(piv).to(A.dtype)
    logabs = torch.log(torch.abs(diag)).sum(-1)
    return sign, logabs, LU, piv


def cholesky_lower(A):
    """(L, info) as LAPACK potrf: info = j+1 for the first non-positive pivot."""
    n = A.shape[-1]
    L = torch.zeros_like(A)
    info = torch.zeros(A.shape[:-2], dtype=torch.int32, device=A.device)
    cols = _index(n, A.device)
    for j in range(n):
        done = (cols < j)
        ljrow = torch.where(done, L[..., j, :], torch.zeros_like(L[..., j, :]))  # L[j, :j]
        d = A[..., j, j] - (ljrow * ljrow).sum(-1)
        bad = ~(d > 0)
        info = torch.where(bad & (info == 0), torch.full_like(info, j + 1), info)
        ljj = torch.sqrt(torch.where(bad, torch.ones_like(d), d))
        # column j below the diagonal: (A[i, j] - L[i, :j] . L[j, :j]) / L[j, j]
        dots = (torch.where(done, L, torch.zeros_like(L)) * ljrow.unsqueeze(-2)).sum(-1)  # [..., n]
        column = (A[..., :, j] - dots) / ljj.unsqueeze(-1)
        column = torch.where(cols == j, ljj.unsqueeze(-1), column)
        column = torch.where(cols < j, torch.zeros_like(column), column)
        L = torch.where((cols == j).unsqueeze(-2), column.unsqueeze(-1), L)
    return L, info


def linalg_cholesky_ex(A, *, upper=False, check_errors=False):
    _check(A)
    _square(A)
    if check_errors:
        raise NotCompilable("cholesky with check_errors (raises on the host)")
    L, info = cholesky_lower(A)
    return (L.transpose(-2, -1).contiguous() if upper else L), info


def cholesky(A, upper=False):
    L, _ = linalg_cholesky_ex(A, upper=upper)
    return L


def linalg_solve_triangular(A, B, *, upper, left=True, unitriangular=False):
    _check(A, B)
    if not left:
        # X A = B  <=>  A^T X^T = B^T
        return linalg_solve_triangular(A.transpose(-2, -1), B.transpose(-2, -1), upper=not upper,
                                       unitriangular=unitriangular).transpose(-2, -1)
    _square(A)
    batch = torch.broadcast_shapes(A.shape[:-2], B.shape[:-2])
    A = A.expand(*batch, *A.shape[-2:])
    B = B.expand(*batch, *B.shape[-2:])
    T = torch.triu(A) if upper else torch.tril(A)
    return _triangular_solve(T, B, upper, unitriangular)


def triangular_solve(B, A, upper=True, transpose=False, unitriangular=False):
    _check(A, B)
    if transpose:
        A, upper = A.transpose(-2, -1), not upper
    X = linalg_solve_triangular(A, B, upper=upper, unitriangular=unitriangular)
    return X, A.clone() if not transpose else A.transpose(-2, -1).clone()


def _householder(R, j):
    """LAPACK's larfg on column j of R: (v over all rows, tau, beta)."""
    m = R.shape[-2]
    rows = _index(m, R.device)
    alpha = R[..., j, j]
    below = torch.where(rows > j, R[..., :, j], torch.zeros_like(R[..., :, j]))
    xnorm = torch.sqrt((below * below).sum(-1))
    norm = torch.sqrt(alpha * alpha + xnorm * xnorm)
    beta = torch.where(alpha >= 0, -norm, norm)
    plain = xnorm == 0  # no reflection needed: H = I
    safe_beta = torch.where(plain, torch.ones_like(beta), beta)
    tau = torch.where(plain, torch.zeros_like(beta), (beta - alpha) / safe_beta)
    scale = torch.where(plain, torch.ones_like(beta), alpha - beta)
    v = torch.where(rows == j, torch.ones_like(below), below / scale.unsqueeze(-1))
    v = torch.where(plain.unsqueeze(-1) & (rows > j), below, v)
    return v, tau, torch.where(plain, alpha, beta)


def geqrf(A):
    """(reflectors below the diagonal with R on and above it, tau), as LAPACK."""
    _check(A)
    m, n = A.shape[-2:]
    R = A.clone()
    rows = _index(m, A.device).unsqueeze(-1)
    cols = _index(n, A.device)
    taus = []
    for j in range(min(m, n)):
        v, tau, beta = _householder(R, j)
        w = (v.unsqueeze(-1) * R).sum(-2)  # v^T R
        update = tau.unsqueeze(-1).unsqueeze(-1) * v.unsqueeze(-1) * w.unsqueeze(-2)
        R = torch.where(cols > j, R - update, R)
        column = torch.where(rows.squeeze(-1) == j, beta.unsqueeze(-1), v)
        column = torch.where(rows.squeeze(-1) < j, R[..., :, j], column)
        R = torch.where(cols == j, column.unsqueeze(-1), R)
        taus.append(tau)
    tau = torch.stack(taus, -1) if taus else torch.zeros((*A.shape[:-2], 0), dtype=A.dtype, device=A.device)
    return R, tau


def _q_of(reflectors, tau, columns):
    """Q = H_1 ... H_k applied to the first `columns` columns of I (orgqr)."""
    m = reflectors.shape[-2]
    rows = _index(m, reflectors.device)
    Q = torch.eye(m, columns, dtype=reflectors.dtype, device=reflectors.device).expand(
        *reflectors.shape[:-2], m, columns)
    for j in reversed(range(tau.shape[-1])):
        v = torch.where(rows == j, torch.ones_like(reflectors[..., :, j]), reflectors[..., :, j])
        v = torch.where(rows < j, torch.zeros_like(v), v)
        w = (v.unsqueeze(-1) * Q).sum(-2)
        Q = Q - tau[..., j].unsqueeze(-1).unsqueeze(-1) * v.unsqueeze(-1) * w.unsqueeze(-2)
    return Q


def householder_product(A, tau):
    _check(A, tau)
    return _q_of(A, tau, A.shape[-1])


def linalg_qr(A, mode="reduced"):
    _check(A)
    m, n = A.shape[-2:]
    k = min(m, n)
    reflectors, tau = geqrf(A)
    R = torch.triu(reflectors)
    if mode == "r":
        return torch.empty((0,), dtype=A.dtype, device=A.device), R[..., :k, :]
    if mode == "complete":
        return _q_of(reflectors, tau, m), R
    return _q_of(reflectors, tau, k), R[..., :k, :]


def ormqr(A, tau, C, left=True, transpose=False):
    _check(A, tau, C)
    Q = _q_of(A, tau, A.shape[-2])
    if transpose:
        Q = Q.transpose(-2, -1)
    return Q @ C if left else C @ Q


def _permutation_matrix(pivots, m):
    """P with A = P L U, from LAPACK's sequential row swaps."""
    perm = _index(m, pivots.device).expand(*pivots.shape[:-1], m)
    for k in range(pivots.shape[-1]):
        p = pivots[..., k].to(torch.int64) - 1
        at_k = perm[..., k]
        at_p = torch.where(_index(m, pivots.device) == p.unsqueeze(-1), perm, torch.zeros_like(perm)).sum(-1)
        positions = _index(m, pivots.device)
        perm = torch.where(positions == k, at_p.unsqueeze(-1), perm)
        perm = torch.where(positions == p.unsqueeze(-1), at_k.unsqueeze(-1), perm)
    # Row i of P^T A is row perm[i] of A, so P[perm[i], i] = 1.
    return (_index(m, pivots.device).unsqueeze(-1) == perm.unsqueeze(-2))


def lu_unpack(LU, pivots, unpack_data=True, unpack_pivots=True):
    _check(LU)
    m, n = LU.shape[-2:]
    k = min(m, n)
    empty = torch.empty((0,), dtype=LU.dtype, device=LU.device)
    P = _permutation_matrix(pivots, m).to(LU.dtype) if unpack_pivots else empty
    if not unpack_data:
        return P, empty, empty
    L = torch.tril(LU[..., :, :k], -1) + torch.eye(m, k, dtype=LU.dtype, device=LU.device)
    U = torch.triu(LU[..., :k, :])
    return P, L, U


def linalg_lu(A, *, pivot=True):
    _check(A)
    if not pivot:
        raise NotCompilable("lu without pivoting")
    LU, piv, _ = lu_factor(A)
    return lu_unpack(LU, piv)


def decompositions() -> dict:
    return {
        aten.linalg_lu_factor_ex.default: linalg_lu_factor_ex,
        aten.linalg_inv_ex.default: linalg_inv_ex,
        aten._linalg_solve_ex.default: linalg_solve_ex,
        aten.linalg_lu_solve.default: linalg_lu_solve,
        aten._linalg_det.default: linalg_det,
        aten._linalg_slogdet.default: linalg_slogdet,
        aten.linalg_cholesky_ex.default: linalg_cholesky_ex,
        aten.cholesky.default: cholesky,
        aten.linalg_solve_triangular.default: linalg_solve_triangular,
        aten.triangular_solve.default: triangular_solve,
        aten.geqrf.default: geqrf,
        aten.linalg_householder_product.default: householder_product,
        aten.linalg_qr.default: linalg_qr,
        aten.ormqr.default: ormqr,
        aten.lu_unpack.default: lu_unpack,
        aten.linalg_lu.default: linalg_lu,
    }
