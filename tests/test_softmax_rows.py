"""Softmax and log_softmax over the last dimension compute their rows in
groups (lowering/rules/softmax_rows.py: IREE ran the rows its tiling left
over as scalar code, 20-70x slower than CPU). Results, gradients and inputs
against CPU, and the grouping itself in the traced graph."""

import math

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import torchneuron
from torchneuron.lowering.decompositions import decomposition_table

pytestmark = pytest.mark.compile_wait

SHAPES = [(3000, 24), (2047, 20), (2046, 20), (3, 7, 11, 9), (5, 16), (8, 3), (0, 4), (6,)]


@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_last_dimension_matches_cpu_with_gradients(name, shape, dtype):
    torchneuron.config.set(compile_wait=True)
    torch.manual_seed(math.prod(shape) + len(shape))
    x = (torch.randn(shape) * 4).to(dtype)
    if x.numel() > 4:
        x.view(-1)[3] = -math.inf  # a masked score
    fn = getattr(torch, name)
    xc = x.clone().requires_grad_()
    want = fn(xc, -1)
    xn = x.to("neuron").requires_grad_()
    got = fn(xn, -1)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.cpu(), want.detach(), equal_nan=True, **tol)
    if x.numel():
        grad = torch.randn(shape).to(dtype)
        (want * grad).sum().backward()
        (got * grad.to("neuron")).sum().backward()
        torch.testing.assert_close(xn.grad.cpu(), xc.grad, equal_nan=True, **tol)
    assert torch.equal(xn.detach().cpu(), x)  # the input untouched


def test_other_dimensions_match_cpu():
    torchneuron.config.set(compile_wait=True)
    x = torch.randn(30, 9, 7)
    for dim in (0, 1):
        torch.testing.assert_close(torch.softmax(x.to("neuron"), dim).cpu(), torch.softmax(x, dim))
        torch.testing.assert_close(torch.log_softmax(x.to("neuron"), dim).cpu(), torch.log_softmax(x, dim))


def _views(fn, x):
    graph = make_fx(fn, decomposition_table=decomposition_table())(x).graph
    return [tuple(n.args[1]) for n in graph.nodes if n.op == "call_function" and n.target in
            (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default)]


@pytest.mark.parametrize("op", [torch.ops.aten._softmax.default, torch.ops.aten._log_softmax.default])
def test_rows_are_grouped_in_eights_or_their_power_of_two(op):
    # 3000 rows: 375 groups of 8; 2046 rows: 1023 groups of 2 (a reshape, no
    # copy); 2047 rows: 255 groups of 8 and a tile of the last 7; not over
    # other dimensions.
    assert (375, 8, 24) in _views(lambda x: op(x, -1, False), torch.randn(3000, 24))
    assert (12, 8, 5) in _views(lambda x: op(x, -1, False), torch.randn(3, 4, 8, 5))
    assert (1023, 2, 20) in _views(lambda x: op(x, -1, False), torch.randn(2046, 20))
    assert (255, 8, 20) in _views(lambda x: op(x, 1, False), torch.randn(2047, 20))
    assert not any(len(v) == 3 and v[1] == 8 for v in _views(lambda x: op(x, 0, False), torch.randn(3000, 24)))
