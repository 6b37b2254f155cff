"""LU, Cholesky and triangular solves compile as unrolled graphs for small
matrices and match LAPACK on CPU, pivots and info included (issue:
compile-first eager mode)."""

import pytest
import torch

import torchneuron

torch.manual_seed(0)
_A = torch.randn(3, 5, 5)
_B = torch.randn(3, 5, 2)
_SPD = _A @ _A.mT + 5 * torch.eye(5)
_SINGULAR = _A.clone()
_SINGULAR[:, :, 2] = 0

CASES = {
    "lu_factor": lambda a, b, s: torch.linalg.lu_factor_ex(a),
    "lu_factor_singular_info": lambda a, b, s: torch.linalg.lu_factor_ex(a * (torch.arange(5, device=a.device) != 2)),
    "lu_factor_rectangular": lambda a, b, s: torch.linalg.lu_factor_ex(a[:, :, :3]),
    "inv": lambda a, b, s: torch.linalg.inv(a),
    "solve": lambda a, b, s: torch.linalg.solve(a, b),
    "solve_vector": lambda a, b, s: torch.linalg.solve(a, b[..., 0]),
    "lu_solve": lambda a, b, s: torch.linalg.lu_solve(*torch.linalg.lu_factor(a), b),
    "det": lambda a, b, s: torch.linalg.det(a),
    "slogdet": lambda a, b, s: torch.linalg.slogdet(a),
    "cholesky": lambda a, b, s: torch.linalg.cholesky(s),
    "cholesky_upper_info": lambda a, b, s: torch.linalg.cholesky_ex(s - 20 * torch.eye(5, device=s.device), upper=True).info,
    "solve_triangular": lambda a, b, s: torch.linalg.solve_triangular(a, b, upper=True),
    "solve_triangular_right_unit": lambda a, b, s: torch.linalg.solve_triangular(
        a, b.mT, upper=False, left=False, unitriangular=True),
    "linalg_lu_wide": lambda a, b, s: torch.linalg.lu(a[:, :3, :]),
    "lu_unpack_tall": lambda a, b, s: torch.lu_unpack(*torch.linalg.lu_factor(a[:, :, :3])),
    "qr": lambda a, b, s: torch.linalg.qr(a),
    "qr_complete_wide": lambda a, b, s: torch.linalg.qr(a[:, :3, :], mode="complete"),
    "geqrf_tall": lambda a, b, s: torch.geqrf(a[:, :, :3]),
    "householder_product": lambda a, b, s: torch.linalg.householder_product(*torch.geqrf(a)),
    "ormqr_transposed": lambda a, b, s: torch.ormqr(*torch.geqrf(a), b, transpose=True),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_factorization_compiles_and_matches_lapack(name):
    fn = CASES[name]
    expected = fn(_A, _B, _SPD)
    torchneuron.reset_stats()
    actual = fn(_A.to("neuron"), _B.to("neuron"), _SPD.to("neuron"))
    assert torchneuron.fallback_ops() == {}, torchneuron.fallback_ops()
    expected = expected if isinstance(expected, tuple) else (expected,)
    actual = actual if isinstance(actual, tuple) else (actual,)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a.cpu(), e, rtol=1e-4, atol=1e-4)


@pytest.mark.compile_wait
def test_large_matrices_stay_on_the_host():
    a = torch.randn(40, 40) + 40 * torch.eye(40)
    torchneuron.reset_stats()
    actual = torch.linalg.inv(a.to("neuron")).cpu()
    assert "aten.linalg_inv_ex.default" in torchneuron.fallback_ops()
    torch.testing.assert_close(actual, torch.linalg.inv(a))
