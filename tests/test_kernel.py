"""The kernel language (torchneuron.kernel): each feature compiled on neuron
and simulated on NumPy, against PyTorch CPU; its rules reported at the
kernel's own line; kernels as PyTorch operators (op mode, adaptive eager,
torch.compile, autograd, opcheck)."""

import warnings

import numpy as np
import pytest
import torch

import torchneuron
import torchneuron.kernel as nk


def _close(a, b, tol=1e-5):
    torch.testing.assert_close(a.detach().cpu().float(), b.detach().float(), rtol=tol, atol=tol)


def _both(kernel, grid, make_args, constants, check, tol=1e-5):
    """Run `kernel` simulated on CPU tensors and compiled on neuron; `check`
    gets each run's arguments after the call (outputs written, inputs not)."""
    cpu = make_args()
    originals = [a.clone() for a in cpu]
    nk.simulate(kernel)[grid](*cpu, **constants)
    check(cpu, originals)
    neuron = [a.to("neuron") for a in originals]
    kernel[grid](*neuron, **constants)
    check([a.cpu() for a in neuron], originals)
    for a, b in zip(neuron, cpu):  # the device and the simulator agree on every argument
        _close(a, b, tol)


@nk.jit
def softmax_rows(x, out, ROWS: nk.constexpr):
    i = nk.program_id(0)
    t = nk.load(x[i * ROWS:(i + 1) * ROWS, :])
    e = nk.exp(t - nk.max(t, axis=1, keepdims=True))
    nk.store(out[i * ROWS:(i + 1) * ROWS, :], e / nk.sum(e, axis=1, keepdims=True))


def test_softmax_over_a_grid():
    x = torch.randn(256, 96)

    def check(args, originals):
        _close(args[0], originals[0], 0)  # the input is unchanged
        _close(args[1], torch.softmax(originals[0], dim=1))

    _both(softmax_rows, 2, lambda: [x.clone(), torch.zeros(256, 96)], {"ROWS": 128}, check)


@nk.jit
def tiled_matmul(a, b, out, BM: nk.constexpr, BN: nk.constexpr, BK: nk.constexpr):
    i, j = nk.program_id(0), nk.program_id(1)
    acc = nk.zeros((BM, BN), nk.float32)
    for k in nk.sequential_range(a.shape[1] // BK):
        acc += nk.matmul(nk.load(a[i * BM:(i + 1) * BM, nk.ds(k * BK, BK)]),
                         nk.load(b[nk.ds(k * BK, BK), j * BN:(j + 1) * BN]))
    nk.store(out[i * BM:(i + 1) * BM, j * BN:(j + 1) * BN], acc)


def test_tiled_matmul_accumulates_over_a_sequential_loop():
    a, b = torch.randn(128, 192), torch.randn(192, 96)

    def check(args, originals):
        _close(args[2], originals[0] @ originals[1], 1e-4)

    _both(tiled_matmul, (2, 3), lambda: [a.clone(), b.clone(), torch.zeros(128, 96)],
          {"BM": 64, "BN": 32, "BK": 64}, check, 1e-4)


@nk.jit
def many_ops(x, h, n, out, out_i, out_t):
    t = nk.load(x[...])
    half = nk.cast(nk.load(h[...]), nk.float32)  # bfloat16 in
    y = nk.where(t > 0, nk.tanh(t), nk.sigmoid(t)) * 0.5 - nk.log(nk.abs(t) + 1.0)
    y = nk.maximum(y, half) + nk.minimum(nk.sqrt(nk.abs(t)), 2.0) - nk.min(t, axis=0, keepdims=True)
    nk.store(out[...], y)
    k = nk.load(n[...])
    nk.store(out_i[...], nk.where((k >= 3) & (k != 5), k * 2 - 1, -k))
    nk.store(out_t[...], nk.transpose(t))


def test_tile_math_casts_where_and_transpose():
    x, h = torch.randn(16, 32), torch.randn(16, 32).bfloat16()
    n = torch.randint(-8, 8, (16, 32), dtype=torch.int32)

    def check(args, originals):
        t, half, k = originals[0], originals[1].float(), originals[2]
        y = torch.where(t > 0, torch.tanh(t), torch.sigmoid(t)) * 0.5 - torch.log(t.abs() + 1)
        y = torch.maximum(y, half) + torch.clamp(t.abs().sqrt(), max=2.0) - t.min(0, keepdim=True).values
        _close(args[3], y)
        assert torch.equal(args[4], torch.where((k >= 3) & (k != 5), k * 2 - 1, -k))
        _close(args[5], t.T)

    _both(many_ops, 1, lambda: [x.clone(), h.clone(), n.clone(), torch.zeros(16, 32), torch.zeros(16, 32, dtype=torch.int32),
                                torch.zeros(32, 16)], {}, check)


@nk.jit
def scale_blocks(x, out, B: nk.constexpr):
    for k in nk.affine_range(x.shape[0] // B):  # each iteration its own block: independent
        block = nk.ndarray((B, x.shape[1]), nk.float32)
        block[...] = nk.load(x[nk.ds(k * B, B), :]) * 2.0
        block[0:1, :] = nk.load(x[nk.ds(k * B, 1), :]) * 3.0
        nk.store(out[nk.ds(k * B, B), :], block)


def test_affine_range_with_independent_iterations():
    x = torch.randn(64, 8)
    expected = x * 2.0
    expected[::16] = x[::16] * 3.0

    def check(args, originals):
        _close(args[1], expected)

    _both(scale_blocks, 1, lambda: [x.clone(), torch.zeros(64, 8)], {"B": 16}, check)


@nk.jit
def double_blocks(x, out):
    i, j = nk.program_id(0), nk.program_id(1)
    nk.store(out[i, nk.ds(j * 4, 4)], nk.load(x[i, nk.ds(j * 4, 4)]) * 2.0)


def test_large_grids_launch_in_chunks_or_run_as_a_loop():
    # Up to 64 programs are traced apart and launched at once; a grid of 100
    # launches as 2 chunks of 50 (the chunk's number a runtime argument, one
    # executable); a grid whose programs do not divide so (2 x 67) becomes a
    # loop over program ids (slices at symbolic offsets).
    x = torch.randn(200, 12)

    def check(args, originals):
        _close(args[1], torch.softmax(originals[0], dim=1))

    _both(softmax_rows, 100, lambda: [x.clone(), torch.zeros(200, 12)], {"ROWS": 2}, check)
    chunked = softmax_rows.mlir(100, x, x, ROWS=2)
    assert "scf.for" not in chunked and "tensor.extract" in chunked
    y = torch.randn(2, 268)

    def doubled(args, originals):
        _close(args[1], originals[0] * 2)

    _both(double_blocks, (2, 67), lambda: [y.clone(), torch.zeros(2, 268)], {}, doubled)
    assert "scf.for" in double_blocks.mlir((2, 67), y, y)


@nk.jit
def gather_rows(x, idx, out):
    i = nk.program_id(0)
    rows = nk.load(idx[nk.ds(i * 4, 4)])  # an int32 tile of row numbers
    nk.store(out[nk.ds(i * 4, 4), :], nk.load(x[rows, 2:6]) * 2.0)


def test_loads_gather_rows_by_an_index_tile():
    x = torch.randn(10, 8)
    idx = torch.tensor([3, 1, 9, 0, 5, 5, 2, 7], dtype=torch.int32)

    def check(args, originals):
        _close(args[2], originals[0][originals[1].long(), 2:6] * 2)

    _both(gather_rows, 2, lambda: [x.clone(), idx.clone(), torch.zeros(8, 4)], {}, check)


# -- rules, at the kernel's line -----------------------------------------------------

@nk.jit
def carried_in_affine(x, out):
    acc = nk.zeros((4, 8), nk.float32)
    for k in nk.affine_range(4):
        acc += nk.load(x[k * 4:(k + 1) * 4, :])  # line of the carried read
    nk.store(out[...], acc)


def test_a_carried_dependency_in_affine_range_is_reported_at_its_line():
    line = carried_in_affine.fn.__code__.co_firstlineno + 4  # (the first line is the decorator)
    for run in (lambda: nk.simulate(carried_in_affine)[1](torch.randn(16, 8), torch.zeros(4, 8)),
                lambda: carried_in_affine[1](torch.randn(16, 8, device="neuron"), torch.zeros(4, 8, device="neuron"))):
        with pytest.raises(nk.KernelError, match=rf"test_kernel.py:{line}: .*carried dependency.*sequential_range"):
            run()


@nk.jit
def too_many_rows(x, out):
    nk.store(out[...], nk.load(x[...]))


@nk.jit
def out_of_bounds(x, out):
    i = nk.program_id(0)
    nk.store(out[i * 4:(i + 1) * 4, :], nk.load(x[i * 4 + 1:(i + 1) * 4 + 1, :]))


@nk.jit
def mixed_dtypes(x, n, out):
    nk.store(out[...], nk.load(x[...]) + nk.load(n[...]))


def test_rules_name_the_kernel_line():
    first = too_many_rows.fn.__code__.co_firstlineno
    with pytest.raises(nk.KernelError, match=rf":{first + 2}: a tile's first \(partition\) dimension holds at most 128"):
        nk.simulate(too_many_rows)[1](torch.randn(256, 4), torch.zeros(256, 4))
    first = out_of_bounds.fn.__code__.co_firstlineno
    with pytest.raises(nk.KernelError, match=rf":{first + 3}: dimension 0 of argument `x` has 16 elements.*, 17\)"):
        nk.simulate(out_of_bounds)[4](torch.randn(16, 8), torch.zeros(16, 8))
    with pytest.raises(nk.KernelError, match="float32 and int32 tiles: cast one first"):
        nk.simulate(mixed_dtypes)[1](torch.randn(4, 4), torch.ones(4, 4, dtype=torch.int32), torch.zeros(4, 4))


def test_launch_errors_are_clear():
    with pytest.raises(nk.KernelError, match=r"nk.simulate\(softmax_rows\)"):
        softmax_rows[1](torch.randn(4, 4), torch.zeros(4, 4), ROWS=4)
    with pytest.raises(nk.KernelError, match="only be called inside a kernel"):
        nk.exp(torch.randn(3))
    with pytest.raises(nk.KernelError, match="over a grid"):
        softmax_rows(torch.randn(4, 4), torch.zeros(4, 4), ROWS=4)


@nk.jit
def reads_before_writing(out):
    t = nk.ndarray((4, 4), nk.float32)
    nk.device_print("t =", t)
    nk.store(out[...], t + 1.0)


def test_the_simulator_shows_unwritten_tiles_and_prints(capsys):
    out = np.zeros((4, 4), dtype=np.float32)
    nk.simulate(reads_before_writing)[1](out)
    assert np.isnan(out).all()  # an ndarray starts as NaN in the simulator
    assert "t =" in capsys.readouterr().out


# -- kernels as PyTorch operators ----------------------------------------------------------

@nk.jit
def rmsnorm_kernel(x, w, out, ROWS: nk.constexpr, EPS: nk.constexpr):
    i = nk.program_id(0)
    t = nk.load(x[i * ROWS:(i + 1) * ROWS, :])
    ms = nk.sum(t * t, axis=1, keepdims=True) / t.shape[1]
    nk.store(out[i * ROWS:(i + 1) * ROWS, :], t * nk.rsqrt(ms + EPS) * nk.load(w[0:1, :]))


rmsnorm = nk.op("nktest::rmsnorm", rmsnorm_kernel, outputs=lambda x, w: [(x.shape, x.dtype)],
                grid=lambda x, w: (x.shape[0] // 16,), constants=lambda x, w: {"ROWS": 16, "EPS": 1e-6})


def _rmsnorm_reference(x, w):
    return x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + 1e-6) * w


def test_a_kernel_as_an_operator_in_op_mode_adaptive_and_on_cpu():
    x, w = torch.randn(48, 40), torch.randn(1, 40)
    _close(rmsnorm(x, w), _rmsnorm_reference(x, w))  # CPU tensors: the simulator
    torch.library.opcheck(rmsnorm, (x.to("neuron"), w.to("neuron")))
    for mode in ("op", "adaptive"):
        with torchneuron.eager_mode(mode):
            xn = x.to("neuron") * 2  # pending in adaptive mode: recorded work runs before the kernel
            y = rmsnorm(xn, w.to("neuron")) + 1
            _close(y, _rmsnorm_reference(x * 2, w) + 1)


def test_a_kernel_stays_one_node_under_torch_compile():
    torch._dynamo.reset()
    x, w = torch.randn(48, 40), torch.randn(1, 40)

    def f(x, w):
        return torch.relu(rmsnorm(x * 2, w)) + 1

    before = torchneuron.compile_stats()["dynamo"]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="neuron: a torch.compile")
        out = torch.compile(f, backend="neuron")(x.to("neuron"), w.to("neuron"))
    after = torchneuron.compile_stats()["dynamo"]
    assert after["graphs_around_kernels"] - before.get("graphs_around_kernels", 0) == 1
    assert after.get("graphs_fallback", 0) == before.get("graphs_fallback", 0)
    _close(out, torch.relu(_rmsnorm_reference(x * 2, w)) + 1)
    torch._dynamo.reset()


@nk.jit
def square_kernel(x, out):
    nk.store(out[...], nk.load(x[...]) * nk.load(x[...]))


def _square_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _square_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return grad * 2 * x


square = nk.op("nktest::square", square_kernel, outputs=lambda x: [(x.shape, x.dtype)], grid=lambda x: 1,
               backward=_square_backward, setup_context=_square_setup)


def test_a_kernel_operator_with_a_backward():
    x = torch.randn(8, 12, requires_grad=True)
    xn = x.detach().to("neuron").requires_grad_()
    (square(xn) * 3).sum().backward()
    (x * x * 3).sum().backward()
    _close(xn.grad, x.grad)
    torch.library.opcheck(square, (torch.randn(8, 12, device="neuron"),))
    # (torch's autograd registration check runs on CPU, CUDA and XPU only: CPU's simulator here)
    torch.library.opcheck(square, (torch.randn(8, 12, requires_grad=True),))


def test_a_kernel_launch_is_a_device_event_in_the_profiler():
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(128, 16, device="neuron")
    out = torch.empty(128, 16, device="neuron")
    softmax_rows[1](x, out, ROWS=128)  # compiled before profiling
    torch.neuron.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]) as prof:
        softmax_rows[1](x, out, ROWS=128)
        torch.neuron.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.PrivateUse1]
    assert "kernel softmax_rows" in names, names


@nk.jit
def unrolled_sum(x, out, N: nk.constexpr):
    acc = nk.zeros((4, 8), nk.float32)
    for k in nk.static_range(N):  # unrolled when traced
        acc += nk.load(x[nk.ds(k * 4, 4), :]) * (k + 1.0)
    nk.store(out[...], acc)


def test_static_range_unrolls_and_a_compile_failure_names_the_kernel(monkeypatch):
    x = torch.randn(12, 8)

    def check(args, originals):
        _close(args[1], sum(originals[0][k * 4:(k + 1) * 4] * (k + 1.0) for k in range(3)))

    _both(unrolled_sum, 1, lambda: [x.clone(), torch.zeros(4, 8)], {"N": 3}, check)
    assert "scf.for" not in unrolled_sum.mlir(1, x, torch.zeros(4, 8), N=3)

    from torchneuron.kernel import tracer

    real = tracer.Tracer.module
    monkeypatch.setattr(tracer.Tracer, "module", lambda self: real(self).replace("linalg.fill", "linalg.fil"))
    with pytest.raises(nk.KernelError, match=r"test_kernel.py:\d+: kernel unrolled_sum did not compile .*gap in "
                                             r"torchneuron's kernel lowering: nk.simulate runs it"):
        unrolled_sum[1](x.to("neuron"), torch.zeros(4, 8, device="neuron"), N=2)


def _kernel(body):
    """A kernel (x, out) whose body is `body(x, out)`."""
    def kernel(x, out):
        body(x, out)
    return nk.jit(kernel)


@pytest.mark.parametrize("body, message", [
    (lambda x, out: nk.store(out[::2, :], nk.load(x[::2, :])), "slices take step 1"),
    (lambda x, out: nk.store(out[...], nk.load(x[...])[None]), "None takes a full slice"),
    (lambda x, out: nk.store(out[...], nk.load(x[...])) if nk.load(x[...]) else None, "use nk.where, not `if`"),
    (lambda x, out: nk.store(x, nk.load(x[...])), "writes to a slice of a kernel argument"),
    (lambda x, out: nk.load(x), "takes a slice of a kernel argument"),
    (lambda x, out: nk.load(x[nk.zeros((4,), nk.float32), :]), "takes a 1-D int32 tile"),
    (lambda x, out: nk.store(out[nk.arange(4), :], nk.load(x[...])), "indexing by a tile .* is for loads only"),
    (lambda x, out: nk.matmul(nk.load(x[...]), nk.load(x[0:2, :])), "inner sizes differ"),
    (lambda x, out: nk.program_id(1), r"program_id\(1\): the grid has 1 axes"),
    (lambda x, out: [None for _ in nk.sequential_range(2.5)], "trip count"),
    (lambda x, out: nk.zeros((200, 4)), "partition"),
    (lambda x, out: nk.zeros((4, 4), "float64"), "unsupported tile dtype"),
    (lambda x, out: nk.exp(nk.load(x[...]).astype(nk.int32)), "takes float tiles"),
])
def test_each_rule_is_a_kernel_error(body, message):
    with pytest.raises(nk.KernelError, match=message):
        nk.simulate(_kernel(body))[1](torch.randn(4, 4), torch.zeros(4, 4))


def test_launch_and_registration_errors_are_kernel_errors():
    with pytest.raises(nk.KernelError, match="0-dim tensor"):
        nk.simulate(softmax_rows)[1](torch.randn(()), torch.zeros(()), ROWS=1)
    with pytest.raises(nk.KernelError, match="dtype torch.float64 are not supported"):
        nk.simulate(softmax_rows)[1](torch.randn(4, 4, dtype=torch.float64), torch.zeros(4, 4), ROWS=4)
    with pytest.raises(nk.KernelError, match="a grid is one or more positive ints"):
        softmax_rows[0]
    with pytest.raises(nk.KernelError, match="takes an @nk.jit kernel"):
        nk.op("nktest::plain", softmax_rows.fn, outputs=lambda x: [], grid=lambda x: 1)
    with pytest.raises(nk.KernelError, match="'namespace::name'"):
        nk.op("no_namespace", square_kernel, outputs=lambda x: [(x.shape, x.dtype)], grid=lambda x: 1)
    with pytest.raises(nk.KernelError, match="which leaves 0 outputs"):
        nk.op("nktest::none_out", square_kernel, outputs=lambda x, y: [], grid=lambda x, y: 1)
    with pytest.raises(nk.KernelError, match="nk.simulate takes an @nk.jit kernel"):
        nk.simulate(softmax_rows.fn)
