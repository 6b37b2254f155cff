"""Convolutions as the lowering rewrites them: 1-D and 1x1 ones as batched
products (lowering/rules/convolution_products.py), and every convolution's
backward as plain convolutions and batched products
(lowering/rules/convolution_backward.py). Each against CPU's, for plain and
transposed convolutions with strides, padding (also wider than the kernel's
reach), dilation, groups and output padding; nothing runs on the host, and
the inputs are left as they were."""

import pytest
import torch

import torchneuron

aten = torch.ops.aten

# (spatial dims, batch, in channels, out channels, size, kernel, stride, padding, dilation, groups, output padding)
PLAIN = {
    "3x3 same": (2, 2, 4, 6, 9, 3, 1, 1, 1, 1, 0),
    "3x3 stride 2": (2, 2, 4, 6, 9, 3, 2, 1, 1, 1, 0),
    "windows stop short": (2, 2, 4, 6, 10, 3, 2, 0, 1, 1, 0),
    "stride 3 dilation 2": (2, 2, 4, 6, 11, 3, 3, 2, 2, 1, 0),
    "padding past the reach": (2, 2, 4, 6, 9, 3, 2, 3, 1, 1, 0),
    "1-d grouped": (1, 2, 6, 4, 17, 5, 2, 2, 1, 2, 0),
    "depthwise": (2, 2, 8, 8, 9, 3, 1, 1, 1, 8, 0),
    "3-d": (3, 1, 2, 4, 6, 3, 2, 1, 1, 1, 0),
}
TRANSPOSED = {
    "stride 2": (2, 2, 4, 6, 5, 3, 2, 1, 1, 1, 1),
    "1-d stride 3": (1, 2, 4, 6, 5, 3, 3, 1, 1, 1, 2),
    "grouped dilated": (2, 2, 8, 8, 5, 3, 2, 1, 2, 2, 1),
}


def _case(spec, transposed):
    dims, batch, cin, cout, size, kernel, stride, padding, dilation, groups, extra = spec
    gen = torch.Generator().manual_seed(0)
    x = torch.randn([batch, cin] + [size] * dims, generator=gen)
    shape = [cin, cout // groups] if transposed else [cout, cin // groups]
    w = torch.randn(shape + [kernel] * dims, generator=gen)
    params = ([stride] * dims, [padding] * dims, [dilation] * dims, transposed, [extra] * dims, groups)
    grad = torch.randn(aten.convolution(x, w, None, *params).shape, generator=gen)
    return grad, x, w, cout, params


PRODUCTS = {  # (input shape, weight shape, keyword arguments)
    "1-d with bias": ((2, 16, 40), (8, 16, 5), dict(padding=2)),
    "1-d dilated strided": ((2, 16, 41), (8, 16, 11), dict(padding=15, dilation=3, stride=2)),
    "1-d windows stop short": ((3, 4, 10), (6, 4, 3), dict(stride=4)),
    "1x1": ((2, 64, 6, 10), (32, 64, 1, 1), {}),
    "1x1 strided padded": ((2, 8, 7, 9), (4, 8, 1, 1), dict(stride=2, padding=1)),
    "1x1x1": ((1, 8, 3, 4, 5), (4, 8, 1, 1, 1), {}),
}


@pytest.mark.op_mode
@pytest.mark.parametrize("name", list(PRODUCTS))
def test_convolutions_as_products_match_cpu(name):
    x_shape, w_shape, kwargs = PRODUCTS[name]
    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(x_shape, generator=gen), torch.randn(w_shape, generator=gen), torch.randn(
        w_shape[0], generator=gen)
    conv = {3: torch.nn.functional.conv1d, 4: torch.nn.functional.conv2d, 5: torch.nn.functional.conv3d}[len(x_shape)]
    before = torchneuron.fallback_ops()
    inputs = [t.neuron() for t in (x, w, b)]
    got = conv(*inputs, **kwargs)
    torch.testing.assert_close(got.cpu(), conv(x, w, b, **kwargs), rtol=1e-4, atol=1e-4)
    for device, original in zip(inputs, (x, w, b)):
        assert torch.equal(device.cpu(), original)
    assert torchneuron.fallback_ops() == before


@pytest.mark.op_mode
@pytest.mark.parametrize("transposed,name", [(False, n) for n in PLAIN] + [(True, n) for n in TRANSPOSED])
def test_convolution_backward_compiles_and_matches_cpu(transposed, name):
    grad, x, w, bias, params = _case((TRANSPOSED if transposed else PLAIN)[name], transposed)
    before = torchneuron.fallback_ops()
    for mask in ([True, True, True], [True, False, False], [False, True, False]):
        expected = aten.convolution_backward(grad, x, w, [bias], *params, mask)
        inputs = [t.neuron() for t in (grad, x, w)]
        got = aten.convolution_backward(*inputs, [bias], *params, mask)
        for i in range(3):
            if mask[i]:
                torch.testing.assert_close(got[i].cpu(), expected[i], rtol=1e-4, atol=1e-4)
            else:
                assert got[i] is None
        for device, original in zip(inputs, (grad, x, w)):
            assert torch.equal(device.cpu(), original)
    assert torchneuron.fallback_ops() == before


@pytest.mark.op_mode
@pytest.mark.parametrize("case", ["2-d", "1-d output padding 2", "grouped padded", "xcodec upsampling",
                                  "depthwise dilated"])
def test_transposed_convolution_trains_on_the_device(case):
    """Autograd through ConvTranspose (decoders' upsampling), whose backward
    (and, depthwise, forward) torch-mlir does not lower: forward and every
    gradient against CPU."""
    F = torch.nn.functional
    x_shape, w_shape, kwargs = {
        "2-d": ((2, 32, 8, 8), (32, 16, 2, 2), dict(stride=2)),
        "1-d output padding 2": ((2, 4, 5), (4, 6, 3), dict(stride=3, padding=1, output_padding=2)),
        "grouped padded": ((2, 8, 8, 8), (8, 4, 3, 3), dict(stride=2, padding=1, output_padding=1, groups=2)),
        "xcodec upsampling": ((2, 16, 1, 40), (16, 8, 1, 10), dict(stride=(1, 5), padding=(0, 3),
                                                                    output_padding=(0, 1))),
        # torch-mlir does not lower its forward (a collapse_shape of the wrong rank)
        "depthwise dilated": ((1, 4, 5, 5), (4, 1, 3, 2), dict(stride=(2, 1), padding=(2, 0), groups=4,
                                                               dilation=(2, 1), output_padding=(1, 0))),
    }[case]
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(x_shape, generator=gen), torch.randn(w_shape, generator=gen)
    b = torch.randn(w_shape[1] * kwargs.get("groups", 1), generator=gen)
    conv = F.conv_transpose1d if len(x_shape) == 3 else F.conv_transpose2d
    leaves = [t.neuron().requires_grad_() for t in (x, w, b)]
    before = torchneuron.fallback_ops()
    out = conv(*leaves, **kwargs)
    out.square().sum().backward()
    assert torchneuron.fallback_ops() == before
    cpu = [t.clone().requires_grad_() for t in (x, w, b)]
    expected = conv(*cpu, **kwargs)
    expected.square().sum().backward()
    torch.testing.assert_close(out.detach().cpu(), expected.detach(), rtol=1e-4, atol=1e-4)
    for got, want, original in zip(leaves, cpu, (x, w, b)):
        torch.testing.assert_close(got.grad.cpu(), want.grad, rtol=1e-4, atol=1e-4)
        assert torch.equal(got.detach().cpu(), original)


@pytest.mark.op_mode
@pytest.mark.parametrize("dim", [0, 2])
def test_weight_normed_convolution_trains_on_the_device(dim):
    """_weight_norm_interface's backward has CPU and CUDA kernels only (encodec's
    weight-normed convolutions ran it on the host): it is decomposed, and the
    gradients of v and g match CPU's."""
    gen = torch.Generator().manual_seed(0)
    v, x = torch.randn(6, 4, 3, generator=gen), torch.randn(2, 4, 9, generator=gen)
    g = torch.randn([6, 1, 1] if dim == 0 else [1, 1, 3], generator=gen)

    def loss(v, g, x):
        w, _ = torch._weight_norm_interface(v, g, dim)
        return torch.nn.functional.conv1d(x, w, padding=1).square().sum()

    leaves = [t.neuron().requires_grad_() for t in (v, g)]
    before = torchneuron.fallback_ops()
    loss(*leaves, x.neuron()).backward()
    assert torchneuron.fallback_ops() == before
    cpu = [t.clone().requires_grad_() for t in (v, g)]
    loss(*cpu, x).backward()
    for got, want in zip(leaves, cpu):
        torch.testing.assert_close(got.grad.cpu(), want.grad, rtol=1e-4, atol=1e-4)
