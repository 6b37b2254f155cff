"""No op writes memory it does not own (issue 11: trustworthy results).

Regression tests for what a new user found on the compiled path, each
compared with CPU, results and every argument after the call."""

import pytest
import torch

import torchneuron
from torchneuron.eval import argument_checks, conformance


def _same_call(fn, *args):
    """Run fn on CPU and on neuron from the same values; compare the results
    and every argument afterwards (bit for bit where CPU leaves it unchanged)."""
    cpu_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    dev_args = [a.to("neuron") if isinstance(a, torch.Tensor) else a for a in args]
    cpu_in, dev_in = argument_checks.tensor_leaves(cpu_args), argument_checks.tensor_leaves(dev_args)
    cpu_before, dev_before = argument_checks.snapshot(cpu_in), argument_checks.snapshot(dev_in)
    expected = fn(*cpu_args)
    got = fn(*dev_args)
    torch.neuron.synchronize()
    argument_checks.check_unchanged(dev_in, dev_before, cpu_in, cpu_before)
    argument_checks.check_aliasing(argument_checks.tensor_leaves(got), dev_in,
                                   argument_checks.tensor_leaves(expected), cpu_in)
    torch.testing.assert_close(
        [t.cpu() for t in argument_checks.tensor_leaves(got)], argument_checks.tensor_leaves(expected)
    )
    return got


_X = torch.randn(6, 6)
_I = torch.randint(0, 6, (2, 6))
_S = torch.randn(2, 6)
_ROWS = torch.tensor([4, 0, 2])


@pytest.mark.parametrize(
    "name,fn,args",
    [
        ("sort", lambda x: x.sort(0), (_X,)),
        ("sort 1-D descending", lambda x: x.sort(descending=True), (_X[0].clone(),)),
        ("argsort", lambda x: x.argsort(1), (_X,)),
        ("msort", lambda x: x.msort(), (_X,)),
        ("topk", lambda x: x.topk(3, 1), (_X,)),
        ("kthvalue", lambda x: x.kthvalue(2, 1), (_X,)),
        ("scatter", lambda x, i, s: x.scatter(0, i, s), (_X, _I, _S)),
        ("scatter_add", lambda x, i, s: x.scatter_add(0, i, s), (_X, _I, _S)),
        ("scatter_reduce amax", lambda x, i, s: x.scatter_reduce(0, i, s, "amax"), (_X, _I, _S)),
        ("index_add", lambda x, i, s: x.index_add(0, i, s), (_X, _ROWS, torch.randn(3, 6))),
        ("index_copy", lambda x, i, s: x.index_copy(0, i, s), (_X, _ROWS, torch.randn(3, 6))),
        ("index_fill", lambda x, i: x.index_fill(1, i, -1.0), (_X, _ROWS)),
        ("index_put", lambda x, i, s: x.index_put((i,), s), (_X, _ROWS, torch.randn(3, 6))),
        ("put", lambda x, i, s: x.put(i, s), (_X, _ROWS, torch.randn(3))),
        ("one-hot by scatter", lambda t: torch.zeros(5, 4).to(t.device).scatter(1, t, 1.0), (torch.tensor([[0], [3], [1], [1], [2]]),)),
    ],
)
def test_out_of_place_ops_leave_their_inputs_alone(name, fn, args):
    _same_call(fn, *args)


_N = torch.randint(-5, 5, (6, 6))
_NI = torch.randint(-5, 5, (2, 6))


@pytest.mark.compile_wait
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8], ids=str)
@pytest.mark.parametrize(
    "name,fn,args",
    [
        ("sort", lambda x: x.sort(0), (_N,)),
        ("scatter", lambda x, i, s: x.scatter(0, i, s), (_N, _I, _NI)),
        ("scatter_add", lambda x, i, s: x.scatter_add(0, i, s), (_N, _I, _NI)),
        ("index_add", lambda x, i, s: x.index_add(0, i, s), (_N, _ROWS, _NI[:1].expand(3, 6).clone())),
        ("index_copy", lambda x, i, s: x.index_copy(0, i, s), (_N, _ROWS, _NI[:1].expand(3, 6).clone())),
        ("index_put", lambda x, i, s: x.index_put((i,), s), (_N, _ROWS, _NI[:1].expand(3, 6).clone())),
    ],
)
def test_integer_ops_that_update_a_copy_compile_and_leave_their_inputs_alone(name, fn, args, dtype):
    """IREE works on such an input in place: the input it must keep is
    marked written back with its own value, which for integer types needed a
    bitcast to compile at all (they all ran on the host before)."""
    args = [a.to(dtype) if a.dtype == torch.int64 and a is not _I and a is not _ROWS else a for a in args]
    torchneuron.reset_stats()
    _same_call(fn, *args)
    assert torchneuron.fallback_ops() == {}


def test_sort_input_stays_usable_afterwards():
    """The issue's example: later ops on the sorted input compute on its own values."""
    b = torch.randn(6, 6)
    bn = b.to("neuron")
    bn.sort(0)
    assert torch.equal(bn.cpu(), b)
    torch.testing.assert_close((bn * 2).sum().cpu(), (b * 2).sum())


def test_in_place_variants_still_write():
    x = torch.randn(6, 6)
    xn = x.to("neuron")
    i = torch.randint(0, 6, (2, 6))
    s = torch.randn(2, 6)
    xn.scatter_(0, i.to("neuron"), s.to("neuron"))
    x.scatter_(0, i, s)
    torch.testing.assert_close(xn.cpu(), x)


def test_the_compiler_finds_inputs_updated_in_place():
    """The flow-level check names the input IREE would sort in place, and
    nothing for an op that only reads its input."""
    import iree.compiler as ireec

    from torchneuron.compiler import target_flags
    from torchneuron.compiler.read_only_inputs import inputs_written_in_place, protect_inputs
    from torchneuron.dispatch.op_info import op_info
    from torchneuron.lowering import lower_call, signature_of

    def flow_of(op, *args):
        info = op_info(op)
        mlir = lower_call(op, info, signature_of(op, info, args, {})).mlir
        backend, flags = target_flags()
        flow = ireec.compile_str(mlir, input_type="torch", target_backends=[backend],
                                 extra_args=[*flags, "--compile-to=flow"])
        return mlir, flow.decode()

    # (an integer sort: a float one sorts keys computed from its input)
    x = torch.randint(0, 9, (6, 6)).neuron()
    mlir, flow = flow_of(torch.ops.aten.sort.default, x, 0)
    assert inputs_written_in_place(flow) == {0}
    protected = protect_inputs(mlir, {0})
    assert "overwrites %arg0_in" in protected
    backend, flags = target_flags()
    ireec.compile_str(protected, input_type="torch", target_backends=[backend], extra_args=list(flags))
    _, flow = flow_of(torch.ops.aten.add.Tensor, x, x)
    assert inputs_written_in_place(flow) == set()


def _one_sample_opinfo(name, fn):
    """An OpInfo-shaped object for the runner: one op, one 4-float sample."""
    op = type("OpInfoUnderTest", (), {})()
    op.name, op.variant_test_name, op.op = name, "", fn
    op.skips, op.decorators = (), ()
    op.sample_inputs = lambda device, dtype, requires_grad=False: [
        type("Sample", (), {"input": torch.randn(4), "args": (), "kwargs": {}})()
    ]
    return op


def test_the_conformance_check_catches_an_op_that_writes_its_input():
    """The runner's argument check fails an op whose results are right but
    which also changes an argument that CPU leaves alone."""

    def sneaky(x):
        result = x * 2
        if x.device.type == "neuron":
            x.add_(1)  # what a miscompiled op does to its input
        return result

    result = conformance.run_op(_one_sample_opinfo("sneaky", sneaky), torch.float32, max_samples=1)
    assert result.status == "fail"
    assert "only reads on CPU" in result.error


def test_the_conformance_check_catches_a_result_aliasing_its_input():
    def aliasing(x):
        return x if x.device.type == "neuron" else x.clone()

    result = conformance.run_op(_one_sample_opinfo("aliasing", aliasing), torch.float32, max_samples=1)
    assert result.status == "fail" and "shares memory" in result.error


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: x.bitwise_xor(5),
        lambda x: x.bitwise_and(6),
        lambda x: x.bitwise_or(True),
        lambda x: torch.bitwise_left_shift(x, 2),
        lambda x: x.to(torch.uint8).bitwise_xor(44),
        lambda x: torch.remainder(x, 5),
        lambda x: torch.fmod(x.float(), 2.5),
        lambda x: x.float().pow(2),
        lambda x: torch.where(x > 5, x, 7),
    ],
)
def test_scalar_overloads_take_python_numbers(fn):
    x = torch.arange(12)
    got = _same_call(fn, x)
    assert got.dtype == fn(x).dtype


@pytest.mark.parametrize("cls", [torch.nn.LSTM, pytest.param(torch.nn.GRU, marks=pytest.mark.thorough),
                                 torch.nn.LSTMCell, torch.nn.GRUCell])
def test_recurrent_layers_train_as_on_cpu(cls):
    """nn.LSTM and nn.GRU reach the fused cells PyTorch sends accelerators
    (CPU has no kernel for them): forward and every gradient match CPU."""
    torch.manual_seed(0)
    layered = cls in (torch.nn.LSTM, torch.nn.GRU)
    kwargs = dict(num_layers=2, batch_first=True) if layered else {}
    cpu = cls(8, 16, **kwargs)
    dev = cls(8, 16, **kwargs)
    dev.load_state_dict(cpu.state_dict())
    dev = dev.to("neuron")
    x = torch.randn(3, 5, 8) if layered else torch.randn(3, 8)
    xd = x.to("neuron").requires_grad_()
    x.requires_grad_()
    out, outd = cpu(x), dev(xd)
    out, outd = (out[0], outd[0]) if isinstance(out, tuple) else (out, outd)
    out.square().sum().backward()
    outd.square().sum().backward()
    torch.testing.assert_close(outd.cpu(), out.detach(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(xd.grad.cpu(), x.grad, rtol=1e-4, atol=1e-4)
    for p, pd in zip(cpu.parameters(), dev.parameters()):
        torch.testing.assert_close(pd.grad.cpu(), p.grad, rtol=1e-4, atol=1e-4)
    assert not any("thnn" in op for op in torchneuron.fallback_ops())


def test_an_op_with_no_host_kernel_and_no_decomposition_says_so():
    """_masked_scale has a CUDA kernel only: when the compiler declines it too,
    the error names the op and why, instead of PyTorch's dispatcher failure."""
    x = torch.randn(4, device="neuron")
    mask = torch.ones(4, dtype=torch.uint8, device="neuron")
    with pytest.raises(NotImplementedError, match=r"aten\._masked_scale\.default has no kernel on the host"):
        torch.ops.aten._masked_scale(x, mask, 2.0)


def _assign_by_mask(x, mask, value, rows):
    y = x * 1
    y[mask] = value
    z = x * 1
    z[mask] = rows  # one row per true element
    return y, z, torch.index_put(x, (mask,), value, accumulate=True)


@pytest.mark.parametrize("hits", [0, 1, 5], ids=["no-true", "one-true", "five-true"])
@pytest.mark.parametrize("how", ["eager", "adaptive", "compiled"])
def test_assigning_through_a_boolean_mask_writes_only_where_it_is_true(hits, how):
    """x[mask] = v with an all-False mask wrote v into element 0 (the compiled
    index_put of a mask padded its empty index list with 0)."""
    x = torch.arange(24.0).reshape(4, 6) + 5
    mask = torch.zeros(4, 6, dtype=torch.bool)
    mask.view(-1)[torch.randperm(24)[:hits]] = True
    rows = torch.arange(float(hits)) * -1
    args = (x, mask, torch.tensor(0.5), rows)
    expected = _assign_by_mask(*args)
    dev = [a.to("neuron") for a in args]
    if how == "compiled":
        got = torch.compile(_assign_by_mask, backend="neuron")(*dev)
    elif how == "adaptive":
        with torchneuron.eager_mode("adaptive"):
            torchneuron.config.set(compile_wait=True)  # the fused graph from the first call
            got = _assign_by_mask(*dev)
    else:
        got = _assign_by_mask(*dev)
    for g, e in zip(got, expected):
        assert torch.equal(g.cpu(), e)
    assert torch.equal(dev[0].cpu(), x)
    assert torchneuron.fallback_ops().get("aten.index_put.default") is None
