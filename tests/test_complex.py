"""Complex dtypes on neuron: complex64/complex128 tensors, their views, math,
matmuls and the FFT family compiled (complex values as pairs of reals in the
lowering), with autograd, adaptive eager and torch.compile; compared with CPU,
arguments included (issue 18)."""

import pytest
import torch

import torchneuron

torch.manual_seed(0)
A = torch.randn(4, 8, dtype=torch.complex64)
B = torch.randn(4, 8, dtype=torch.complex64)
R = torch.randn(4, 8)


def _window(x):
    return torch.hann_window(8, device=x.device)


# name -> fn(a, b, r): complex a, b and real r of shape (4, 8)
OPS = {
    "add": lambda a, b, r: a + b,
    "sub_alpha": lambda a, b, r: torch.sub(a, b, alpha=2),
    "mul": lambda a, b, r: a * b,
    "div": lambda a, b, r: a / b,
    "mixed_real": lambda a, b, r: a * r + r - a / (r.abs() + 1),
    "python_complex": lambda a, b, r: a * (2 - 1j) + 0.5j,
    "abs_angle": lambda a, b, r: a.abs() + a.angle(),
    "exp_log_sqrt": lambda a, b, r: a.exp() + (b + 3).log() + a.sqrt(),
    "pow_reciprocal_sgn": lambda a, b, r: a**3 + a.reciprocal() + a.sgn(),
    "trig": lambda a, b, r: a.sin() + a.cos() + a.sinh() - a.cosh(),
    "conj_physical": lambda a, b, r: torch.conj_physical(a),
    "conj_view_times": lambda a, b, r: a.conj() * b,
    "real_imag": lambda a, b, r: a.real * 2 + a.imag,
    "view_as_real": lambda a, b, r: torch.view_as_real(a) * 2,
    "view_as_complex": lambda a, b, r: torch.view_as_complex(torch.stack([r, r * 2], -1)),
    "complex_polar": lambda a, b, r: torch.complex(r, r * 3) + torch.polar(r.abs(), r),
    "sum_mean": lambda a, b, r: a.sum(1) + a.mean(1),
    "norms_var_std": lambda a, b, r: torch.linalg.vector_norm(a, dim=1) + a.norm() + a.var(1) + a.std(0).sum(),
    "rsqrt_cumsum_gather": lambda a, b, r: a.rsqrt() + a.cumsum(1) + a.gather(1, (r.abs() * 3).long() % 8),
    "mm": lambda a, b, r: a @ b.T,
    "mm_conj": lambda a, b, r: a @ b.conj().T,
    "bmm": lambda a, b, r: torch.bmm(a.reshape(2, 2, 8), b.reshape(2, 8, 2)),
    "shapes": lambda a, b, r: torch.cat([a.t()[1:5], b.t()[:2]], 0).reshape(2, 12).flip(0),
    "strided_view": lambda a, b, r: a.t() * 2,
    "where_eq": lambda a, b, r: torch.where(r > 0, a, b) + (a == b),
    "to_dtype": lambda a, b, r: a.to(torch.complex128) + r.to(torch.complex128),
    "index": lambda a, b, r: a[torch.tensor([0, 2], device=a.device)] + a[1:3, ::2].repeat(1, 2),
    "in_place": lambda a, b, r: a.clone().mul_(b).add_(1j),
    "fft_ifft": lambda a, b, r: torch.fft.fft(a) + torch.fft.ifft(b, norm="ortho"),
    "fft2_fftn": lambda a, b, r: torch.fft.fft2(a) + torch.fft.ifftn(b),
    "rfft_irfft": lambda a, b, r: torch.fft.irfft(torch.fft.rfft(r) * 2, n=8),
    "irfft_odd": lambda a, b, r: torch.fft.irfft(a, n=9),
    "rfftn_irfftn": lambda a, b, r: torch.fft.irfftn(torch.fft.rfftn(r), s=(4, 8)),
    "hfft_ihfft": lambda a, b, r: torch.fft.hfft(a) + torch.fft.ihfft(r).abs().sum(),
    "fftshift": lambda a, b, r: torch.fft.fftshift(a) + torch.fft.ifftshift(b),
    "stft": lambda a, b, r: torch.stft(r.reshape(-1), 8, hop_length=2, window=_window(r), return_complex=True),
}


def _on_host(before):
    return {k: v - before.get(k, 0) for k, v in torchneuron.fallback_ops().items() if v != before.get(k, 0)}


@pytest.mark.parametrize("name", sorted(OPS))
def test_complex_op_compiles_and_matches_cpu(name):
    fn = OPS[name]
    expected = fn(A, B, R)
    args = [t.to("neuron") for t in (A, B, R)]
    before = torchneuron.fallback_ops()
    got = fn(*args)
    assert got.device.type == "neuron" and got.dtype == expected.dtype
    torch.testing.assert_close(got.cpu(), expected, rtol=2e-5, atol=2e-5)
    for arg, original in zip(args, (A, B, R)):
        torch.testing.assert_close(arg.cpu(), original, rtol=0, atol=0)
    assert _on_host(before) == {}


def test_istft_round_trip():
    signal = torch.randn(64)
    window = torch.hann_window(16)

    def round_trip(x, w):
        spec = torch.stft(x, 16, hop_length=4, window=w, return_complex=True)
        return torch.istft(spec, 16, hop_length=4, window=w, length=64)

    got = round_trip(signal.to("neuron"), window.to("neuron"))
    torch.testing.assert_close(got.cpu(), round_trip(signal, window), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got.cpu(), signal, rtol=1e-4, atol=1e-5)


def test_views_share_memory_with_the_complex_tensor():
    z = A.to("neuron")
    pairs = torch.view_as_real(z)
    assert pairs.data_ptr() == z.data_ptr() and pairs.shape == (4, 8, 2)
    pairs[0, 0, 1] = 5.0  # writes through to z's imaginary part
    z.real.mul_(2)  # and through .real
    expected = A.clone()
    torch.view_as_real(expected)[0, 0, 1] = 5.0
    expected.real.mul_(2)
    torch.testing.assert_close(z.cpu(), expected)
    assert torch.view_as_complex(pairs).data_ptr() == z.data_ptr()


def test_writes_into_conjugate_and_negative_views_apply_their_bits():
    z = A.to("neuron")
    z.conj().copy_(B.to("neuron"))  # z = conj(B)
    torch.testing.assert_close(z.cpu(), B.conj().resolve_conj())
    w = A.to("neuron")
    w.conj().imag.copy_(R.to("neuron"))  # the imaginary part of conj(w) is a negative view of w's
    expected = A.clone()
    expected.conj().imag.copy_(R)
    torch.testing.assert_close(w.cpu(), expected)
    torch.testing.assert_close(w.conj().clone().cpu(), expected.conj().resolve_conj())


def test_gradients_match_cpu():
    h = torch.randn(2, 6, 8)
    q = torch.randn(2, 6, 8)
    w = torch.randn(16)
    x = torch.randn(3, 16)
    freqs = torch.polar(torch.ones(6, 4), torch.randn(6, 4))

    def run(device):
        hh, qq, ww = (t.to(device).requires_grad_() for t in (h, q, w))
        mixed = torch.fft.fft(torch.fft.fft(hh, dim=-1), dim=-2).real  # FNet's token mixing
        rotated = torch.view_as_real(torch.view_as_complex(qq.reshape(2, 6, 4, 2)) * freqs.to(device)).flatten(-2)
        spectral = (torch.fft.rfft(x.to(device) * ww).abs() ** 2).mean()
        loss = mixed.pow(2).sum() + (rotated * qq).sum() + spectral
        loss.backward()
        return [t.detach().cpu() for t in (loss, hh.grad, qq.grad, ww.grad)]

    before = torchneuron.fallback_ops()
    for got, expected in zip(run("neuron"), run("cpu")):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert _on_host(before) == {}


def test_complex_parameter_gradient_matches_cpu():
    weight = torch.randn(8, 8, dtype=torch.complex64)
    x = torch.randn(4, 8, dtype=torch.complex64)

    def run(device):
        wgt = weight.to(device).requires_grad_()
        loss = (x.to(device) @ wgt).abs().sum()
        loss.backward()
        return loss.detach().cpu(), wgt.grad.cpu()

    for got, expected in zip(run("neuron"), run("cpu")):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_complex_graphs_in_adaptive_eager_mode():
    def program(a, b):
        spectrum = torch.fft.fft(a * b + 1j)
        return (spectrum.abs() + spectrum.angle()).sum(0)

    expected = program(A, B)
    args = [A.to("neuron"), B.to("neuron")]
    with torchneuron.eager_mode("adaptive"):
        torchneuron.config.set(compile_wait=False)
        first = program(*args).cpu()  # met for the first time: on the host
        program(*args).cpu()  # recorded; the graph met once: op by op
        program(*args).cpu()  # met again: op by op while the graph compiles
        assert torchneuron.wait_for_compiles(timeout=600)
        fused = torchneuron.adaptive_stats()["ops_fused"]
        again = program(*args).cpu()
        assert torchneuron.adaptive_stats()["ops_fused"] > fused
    torch.testing.assert_close(first, expected, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(again, expected, rtol=2e-5, atol=2e-5)


def test_torch_compile_of_fourier_mixing_forward_and_backward():
    class Mixer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)

        def forward(self, h):
            return self.linear(torch.fft.fft(torch.fft.fft(h, dim=-1), dim=-2).real).relu()

    model = Mixer()
    h = torch.randn(2, 6, 8)
    on_device = Mixer()
    on_device.load_state_dict(model.state_dict())
    compiled = torch.compile(on_device.to("neuron"), backend="neuron")
    hn = h.to("neuron").requires_grad_()
    out = compiled(hn)
    out.sum().backward()
    hc = h.clone().requires_grad_()
    expected = model(hc)
    expected.sum().backward()
    torch.testing.assert_close(out.detach().cpu(), expected.detach(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(hn.grad.cpu(), hc.grad, rtol=1e-4, atol=1e-4)
    assert torchneuron.compile_stats()["dynamo"]["graphs_compiled"] >= 2


@pytest.mark.compile_wait
def test_a_complex_op_without_a_rule_runs_on_the_host_and_is_recorded():
    z = A.to("neuron")
    before = torchneuron.fallback_ops()
    got = torch.linalg.eigvals(z[:, :4])  # no compiled complex eigen solver
    torch.testing.assert_close(got.cpu(), torch.linalg.eigvals(A[:, :4]), rtol=1e-4, atol=1e-4)
    assert _on_host(before)


@pytest.mark.parametrize("n", [3000, 4096 * 3])
def test_long_ffts_split_into_shorter_ones(n):
    """Past 1024 points one DFT matrix would be n^2 elements (12288: 1.2 GB):
    the transform is split (four-step) into shorter ones, each compiled."""
    x = torch.randn(2, n)
    z = torch.randn(2, n, dtype=torch.complex64)
    before = torchneuron.fallback_ops()
    cases = [
        (torch.fft.fft, z), (torch.fft.ifft, z), (torch.fft.rfft, x),
        (lambda t: torch.fft.irfft(t, n=n), z[:, : n // 2 + 1]),
    ]
    for fn, arg in cases:
        expected = fn(arg)
        got = fn(arg.to("neuron")).cpu()
        scale = expected.abs().max()
        torch.testing.assert_close(got / scale, expected / scale, rtol=0, atol=2e-6)
    assert _on_host(before) == {}


@pytest.mark.compile_wait
def test_an_fft_with_a_long_prime_length_runs_on_the_host_and_is_recorded():
    z = torch.randn(2053, dtype=torch.complex64)  # prime: no split, and 2053^2 is too big a matrix
    before = torchneuron.fallback_ops()
    torch.testing.assert_close(torch.fft.fft(z.to("neuron")).cpu(), torch.fft.fft(z))
    assert _on_host(before) == {"aten._fft_c2c.default": 1}


def test_numbers_beside_complex_tensors_stay_runtime_inputs():
    """`z + 3`, `z * 2.5`: the number is a runtime input, as for real tensors.
    Before, lowering it failed, and the retry keyed add/mul's numbers as
    constants for every later call of the process, real ones included."""
    from torchneuron.dispatch.op_info import op_info
    from torchneuron.lowering import call, graph

    z = A.to("neuron")
    # (What an earlier test of this process made constant does not count here.)
    names = {"aten.add.Tensor", "aten.mul.Tensor"}
    earlier = names & call.baked_ops
    call.baked_ops.difference_update(names)
    try:
        for op, number in ((torch.ops.aten.add.Tensor, 3), (torch.ops.aten.mul.Tensor, 2.5)):
            sig = call.signature_of(op, op_info(op), (z, number), {})
            assert sig.ints + sig.floats == [number]
            graph.lower_call(op, op_info(op), sig)  # lowers with the number as an input
        assert not names & call.baked_ops
    finally:
        call.baked_ops.update(earlier)
    for s in (1.5, -2.0):
        torch.testing.assert_close((z * s + 3).cpu(), A * s + 3)
