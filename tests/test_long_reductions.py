"""Long sums and long matrix products are as close to exact as CPU's.

IREE accumulates a reduction in order, so its float32 error grows with the
reduction's length (rows of 16485: 22x CPU's; a product with K = 8192: 5x);
the lowering sums long reductions in blocks (lowering/long_sums.py, split_k.py).
Each case compares neuron's and CPU's distance from the float64 answer."""

import pytest
import torch

import torchneuron  # noqa: F401


def _errors(fn, *inputs):
    exact = fn(*[x.double() for x in inputs])
    cpu = fn(*inputs).double()
    before = [x.clone() for x in inputs]
    got = fn(*[x.to("neuron") for x in inputs]).cpu()
    for x, b in zip(inputs, before):
        assert torch.equal(x, b)
    assert got.shape == exact.shape and got.dtype == torch.float32
    got = got.double()
    return (got - exact).abs().mean().item(), (cpu - exact).abs().mean().item()


def _check(fn, *inputs, factor):
    device_error, cpu_error = _errors(fn, *inputs)
    assert device_error <= factor * cpu_error, f"neuron {device_error:.2e} vs CPU {cpu_error:.2e} from float64"


@pytest.mark.parametrize("case", ["row sums", "row means", "column sums", "sums over two dimensions", "row norms"])
def test_long_sums_are_as_close_as_cpus(case):
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(32, 16485, generator=gen)
    fn = {
        "row sums": lambda x: x.sum(-1),
        "row means": lambda x: x.mean(-1, keepdim=True),
        "column sums": lambda x: x.t().sum(0),
        "sums over two dimensions": lambda x: x.reshape(8, 4, 16485).sum((1, 2)),
        "row norms": lambda x: torch.linalg.vector_norm(x, dim=-1),
    }[case]
    # In order: 9.6x CPU's error for the rows, 49x for two dimensions (65940
    # terms). In blocks: 1.3x and 2.1x (near the final rounding's own error).
    _check(fn, rows, factor=2.5)


@pytest.mark.parametrize("case", ["mm", "linear", "bmm", "matmul"])
def test_long_products_are_as_close_as_cpus(case):
    gen = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=gen)

    fn, inputs = {
        "mm": (torch.mm, (r(16, 8192), r(8192, 32))),
        "linear": (torch.nn.functional.linear, (r(16, 8192), r(32, 8192), r(32))),
        "bmm": (torch.bmm, (r(4, 16, 3145), r(4, 3145, 16))),
        "matmul": (torch.matmul, (r(2, 16, 5000), r(5000, 8))),
    }[case]
    # Whole: 2.5-4.1x CPU's error; in blocks: 0.7-1.1x.
    _check(fn, *inputs, factor=2)


def test_a_long_sum_of_float16_accumulates_in_float32_and_in_blocks():
    x = torch.randn(8, 20000, generator=torch.Generator().manual_seed(1)).half()
    got = x.to("neuron").sum(-1).cpu()
    torch.testing.assert_close(got, x.sum(-1), rtol=1e-3, atol=1e-2)
