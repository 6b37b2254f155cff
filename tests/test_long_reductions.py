"""Long sums and long matrix products are as close to exact as CPU's.

IREE accumulates a reduction in order, so its float32 error grows with the
reduction's length (rows of 16485: 22x CPU's; a product with K = 8192: 5x);
the lowering sums long reductions in blocks (lowering/rules/long_sums.py, split_k.py,
long_convolutions.py).
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


@pytest.mark.parametrize("case", ["1-d with bias", "2-d padded", "2-d strided", "1x1 over many channels"])
def test_long_convolutions_are_as_close_as_cpus(case):
    gen = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=gen)

    F = torch.nn.functional
    fn, inputs = {
        "1-d with bias": (lambda x, w, b: F.conv1d(x, w, b, padding=15, dilation=3), (r(2, 256, 64), r(64, 256, 11),
                                                                                       r(64))),
        "2-d padded": (lambda x, w: F.conv2d(x, w, padding=1), (r(2, 512, 10, 10), r(64, 512, 3, 3))),
        "2-d strided": (lambda x, w: F.conv2d(x, w, stride=2, padding=1), (r(2, 256, 12, 12), r(64, 256, 3, 3))),
        "1x1 over many channels": (F.conv2d, (r(2, 3328, 4, 4), r(32, 3328, 1, 1))),
    }[case]
    # Whole: 3.0-4.4x CPU's mean error here (to 12x for census shapes); in
    # blocks of input channels: 1.2-1.8x.
    _check(fn, *inputs, factor=2)


@pytest.mark.parametrize("case", ["weight 1x1", "weight 1x3 strided", "input 1-d", "input and weight 3x3"])
def test_long_convolution_gradients_are_as_close_as_cpus(case):
    gen = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=gen)

    grad, x, weight, stride, padding, mask = {
        "weight 1x1": (r(2, 16, 80, 80), r(2, 16, 80, 80), r(16, 16, 1, 1), [1, 1], [0, 0], [True, True, False]),
        "weight 1x3 strided": (r(2, 16, 40, 40), r(2, 8, 80, 80), r(16, 8, 1, 3), [2, 2], [0, 1], [False, True, True]),
        "input 1-d": (r(2, 1536, 11), r(2, 32, 11), r(1536, 32, 3), [1], [1], [True, False, False]),
        "input and weight 3x3": (r(2, 256, 6, 6), r(2, 8, 6, 6), r(256, 8, 3, 3), [1, 1], [1, 1], [True, True, True]),
    }[case]

    def backward(grad, x, weight, part):
        return torch.ops.aten.convolution_backward(grad, x, weight, [weight.shape[0]], stride, padding,
                                                   [1] * len(stride), False, [0] * len(stride), 1, mask)[part]

    # Whole: the input's gradient 3.5-5x CPU's mean error, the weight's over
    # 12800 positions 2.9x; in blocks 0.3-1.9x.
    for part in range(3):
        if mask[part]:
            _check(lambda *t: backward(*t, part), grad, x, weight, factor=2.5)


def test_a_long_sum_of_float16_accumulates_in_float32_and_in_blocks():
    x = torch.randn(8, 20000, generator=torch.Generator().manual_seed(1)).half()
    got = x.to("neuron").sum(-1).cpu()
    torch.testing.assert_close(got, x.sum(-1), rtol=1e-3, atol=1e-2)


@pytest.mark.parametrize("case", ["cumsum rows", "cumsum columns", "cumprod"])
def test_long_scans_are_as_close_as_cpus(case):
    """CPU's cumsum/cumprod carry float32's running value in float64; IREE's scan
    carried it in float32 (100000 terms: 200x CPU's distance from float64)."""
    gen = torch.Generator().manual_seed(0)
    fn, x = {
        "cumsum rows": (lambda x: x.cumsum(1), torch.rand(2, 100000, generator=gen)),
        "cumsum columns": (lambda x: x.cumsum(0), torch.rand(20000, 3, generator=gen)),
        "cumprod": (lambda x: x.cumprod(1), 1 + torch.rand(2, 2000, generator=gen) / 500),
    }[case]
    _check(fn, x, factor=1.01)
