"""Compile-first eager mode: ops run as cached IREE executables, asynchronously
(issue: compile-first eager mode)."""

import subprocess
import sys

import pytest
import torch

import torchneuron
from torchneuron.compiler import CompileError, compile_mlir
from torchneuron.runtime import NeuronAsyncError, device_queue

# These tests check op-by-op eager's own mechanisms (one executable per
# signature, cheap-key launches, lanes); adaptive eager has its own tests.
pytestmark = pytest.mark.op_mode


def _compiles() -> int:
    """Executables this process obtained: compiled here or read from a cache
    layer (another process sharing the cache dir may have compiled one first)."""
    return sum(torchneuron.compile_stats()["sources"].values())


def test_common_ops_run_compiled_and_match_cpu():
    torch.manual_seed(0)
    x, w = torch.randn(6, 8), torch.randn(8, 8)
    idx = torch.tensor([4, 0, 2])
    cases = [
        lambda x, w, i: torch.softmax(x @ w, -1),
        lambda x, w, i: torch.nn.functional.layer_norm(x, (8,)),
        lambda x, w, i: torch.nn.functional.gelu(x).sum(0),
        lambda x, w, i: torch.cat([x, x * 2], 0).mean(1),
        lambda x, w, i: torch.where(x > 0, x, -x).amax(-1),
        lambda x, w, i: torch.nn.functional.embedding(i, w),
        lambda x, w, i: x.index_select(0, i),
        lambda x, w, i: (x.to(torch.float16) * 3).to(torch.float32),
        lambda x, w, i: torch.tril(x[:, :6]).cumsum(0),
    ]
    torchneuron.reset_stats()
    for fn in cases:
        expected = fn(x, w, idx)
        actual = fn(x.neuron(), w.neuron(), idx.neuron())
        torch.testing.assert_close(actual.cpu(), expected, rtol=1e-4, atol=1e-4)
    assert torchneuron.fallback_ops() == {}
    assert torchneuron.execution_stats()["ops_compiled"] >= len(cases)


def test_each_signature_compiles_once_and_scalars_are_runtime_inputs():
    # A size no other test uses: the warm start may preload what other processes
    # sharing the cache dir (the distributed tests' ranks) built.
    x = torch.randn(37, device="neuron")
    y = torch.randn(37, device="neuron")
    x.add_(y, alpha=0.5)  # first time: compiles
    before = _compiles()
    expected = x.cpu()
    for alpha in (0.25, 1.5, -2.0, 3.0):
        x.add_(y, alpha=alpha)
        expected = expected + alpha * y.cpu()
    x.mul_(1.5)
    x.mul_(0.5)  # the same executable as mul_(1.5)
    expected = expected * 1.5 * 0.5
    torch.testing.assert_close(x.cpu(), expected, rtol=1e-5, atol=1e-5)
    assert _compiles() - before == 1  # only mul_: every alpha reused add_'s executable


def test_adamw_with_changing_lr_stops_compiling_after_step_2():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)).to("neuron")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    x, y = torch.randn(4, 8, device="neuron"), torch.randn(4, 1, device="neuron")
    before = torchneuron.fallback_ops()
    compiles = []
    for _ in range(50):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        loss.item()
        compiles.append(_compiles())
    assert compiles[-1] == compiles[1], f"compiled after step 2: {compiles}"
    on_host = {k for k, n in torchneuron.fallback_ops().items() if n != before.get(k, 0)}
    assert on_host <= {"aten.normal_.default", "aten.uniform_.default"}


def test_strided_and_unaligned_inputs_are_read_in_place():
    base = torch.arange(64.0).reshape(8, 8)
    n = base.neuron()
    torchneuron.reset_stats()
    cases = [
        lambda t: t.t() + 1,  # transposed
        lambda t: t[1:, ::2] * 2,  # strided, offset
        lambda t: t.view(-1)[3:13].exp(),  # contiguous but not 64-byte aligned
        lambda t: t[2].expand(3, 8) - 1,  # broadcast view
    ]
    for fn in cases:
        torch.testing.assert_close(fn(n).cpu(), fn(base), rtol=1e-5, atol=1e-5)
    assert torchneuron.fallback_ops() == {}
    assert torchneuron.execution_stats()["ops_compiled"] == len(cases)


def test_writes_through_views_and_out():
    c = torch.arange(24.0).reshape(4, 6)
    n = c.neuron()
    for t in (c, n):
        t[1:3].mul_(10)  # in-place on a contiguous slice
        t[:, 1].add_(100)  # in-place on a strided column
        torch.mul(t[0], 2, out=t[3])  # out= into a view
    torch.testing.assert_close(n.cpu(), c)
    out = torch.empty(0, device="neuron")
    torch.add(n, 1, out=out)  # out= of the wrong size is resized, as on CPU
    torch.testing.assert_close(out.cpu(), c + 1)


def test_launches_are_asynchronous_and_reads_synchronize():
    ref = torch.randn(512, 512) / 32
    a = ref.to("neuron")
    torch.neuron.synchronize()
    queue = device_queue(0)
    c = a
    for _ in range(6):
        c = torch.tanh(c @ a)
    assert queue.pending() > 0  # launched, not finished
    value = c.abs().sum().item()  # a host read waits for all of it
    assert queue.pending() == 0
    r = ref
    for _ in range(6):
        r = torch.tanh(r @ ref)
    assert value == pytest.approx(r.abs().sum().item(), rel=1e-4)


def test_launch_blocking_makes_launches_synchronous():
    torchneuron.config.set(launch_blocking=True)
    a = torch.randn(256, 256, device="neuron")
    a @ a
    assert device_queue(0).pending() == 0


def test_out_of_range_index_raises_at_next_sync_with_source_line():
    w = torch.randn(10, 4, device="neuron")
    bad = torch.tensor([1, 2, 50], device="neuron")
    r = torch.nn.functional.embedding(bad, w)  # the line reported below
    line = test_out_of_range_index_raises_at_next_sync_with_source_line.__code__.co_firstlineno + 3
    with pytest.raises(NeuronAsyncError, match=rf"aten\.embedding\.default.*test_eager_compile\.py:{line}.*out of range"):
        r.sum().item()
    # The device stays usable.
    ok = torch.nn.functional.embedding(torch.tensor([3, 9], device="neuron"), w)
    torch.testing.assert_close(ok.cpu(), w.cpu()[[3, 9]])


def test_compile_error_names_op_shapes_and_diagnostic():
    with pytest.raises(CompileError, match=r"compiling aten\.fake\.default\(float32\[3\]\) failed:(.|\n)*error"):
        compile_mlir("module { this is not mlir }", "aten.fake.default(float32[3])")


def test_rejected_op_runs_on_host_and_is_not_retried():
    x, y = torch.randn(8), torch.randn(8)
    torchneuron.reset_stats()
    r1 = torch.copysign(x.neuron(), y.neuron())  # IREE rejects this op
    failures = torchneuron.compile_stats()["compile_failures"]
    r2 = torch.copysign(x.neuron(), y.neuron())
    torch.testing.assert_close(r1.cpu(), torch.copysign(x, y))
    torch.testing.assert_close(r2.cpu(), torch.copysign(x, y))
    assert torchneuron.fallback_ops()["aten.copysign.Tensor"] == 2
    assert torchneuron.compile_stats()["compile_failures"] == failures  # not compiled again
    assert "aten.copysign.Tensor" in torchneuron.compile_stats()["not_compiled"]
    torchneuron.config.set(fallback="error")
    with pytest.raises(torchneuron.FallbackError, match="copysign"):
        torch.copysign(x.neuron(), y.neuron())


@pytest.mark.parametrize("limit, setting, message, op", [
    ({"compile_timeout_s": 0.01}, "TORCHNEURON_COMPILE_TIMEOUT", "time limit of 0.01 s", "atan2"),
    ({"compile_memory_mb": 16}, "TORCHNEURON_COMPILE_MEMORY_MB", "memory limit of 16 MiB", "hypot"),
])
def test_a_compile_stopped_by_a_limit_runs_on_host_names_the_limit_and_is_tried_again(limit, setting, message, op):
    # A compiler that loops (IREE 3.13 did, growing past 9 GB) is stopped by
    # the time or memory limit; here the limits are set too low for any compile.
    fn = getattr(torch, op)
    x = torch.randn(13, 29, 3) + 1  # a shape no other test uses: its compile happens here
    original = x.clone()
    n = x.neuron()
    (n + 1).cpu()  # the target CPU is resolved (a compile too) before the limit
    torchneuron.reset_stats()
    saved = {name: torchneuron.config.get(name) for name in limit}
    torchneuron.config.set(**limit)
    try:
        r = fn(n, n)
        torch.testing.assert_close(r.cpu(), fn(x, x))
        torch.testing.assert_close(n.cpu(), original)  # the input untouched
        reason = torchneuron.compile_stats()["not_compiled"][f"aten.{op}.default"]
        assert setting in reason and message in reason
        assert torchneuron.fallback_ops()[f"aten.{op}.default"] == 1
    finally:
        torchneuron.config.set(**saved)
    # A limit says nothing about the op: its verdict is not stored for other
    # processes, and the next one compiles it (this one does not try again).
    code = ("import torch, torchneuron\n"
            "x = torch.randn(13, 29, 3) + 1\n"
            f"r = torch.{op}(x.neuron(), x.neuron())\n"
            f"torch.testing.assert_close(r.cpu(), torch.{op}(x, x))\n"
            "assert torchneuron.fallback_ops() == {}, torchneuron.compile_stats()['not_compiled']\n"
            "print('compiled')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


def test_mixed_devices_still_refused_on_compiled_path():
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.randn(3, device="neuron") * torch.randn(3)


def test_second_device_runs_compiled_on_its_own_queue():
    x = torch.randn(16, 16)
    n = x.to("neuron:1")
    y = torch.relu(n @ n)
    assert y.device == torch.device("neuron:1")
    assert device_queue(1).launches > 0
    torch.neuron.synchronize(1)
    torch.testing.assert_close(y.cpu(), torch.relu(x @ x), rtol=1e-4, atol=1e-4)


def test_equal_and_log10_run_on_device():
    x = torch.rand(6) + 0.5
    n = x.neuron()
    torchneuron.reset_stats()
    assert torch.equal(n, n.clone()) and not torch.equal(n, n + 1) and not torch.equal(n, n[:3])
    torch.testing.assert_close(torch.log10(n).cpu(), torch.log10(x))
    assert torchneuron.fallback_ops() == {}


def test_scalars_that_set_result_shapes_stay_constants():
    # arange's end decides its length: it must not become a runtime input.
    for end in (6.0, 10.0, 3.0):
        torch.testing.assert_close(torch.arange(end, device="neuron").cpu(), torch.arange(end))
    torch.testing.assert_close(torch.linspace(0, 1, 5, device="neuron").cpu(), torch.linspace(0, 1, 5))


def _cached_launches() -> int:
    return torchneuron.compile_stats()["cached_launches"]


def test_repeated_calls_launch_by_cheap_key_with_their_own_values():
    torch.manual_seed(0)
    a, b = torch.randn(8, 4), torch.randn(8, 4)
    na, nb = a.neuron(), b.neuron()
    torch.sum(na * nb, [1], keepdim=True)  # the full path compiles and remembers these
    na.add(nb, alpha=0.5)
    before = _cached_launches()
    for alpha in (2.0, -1.0):  # a keyword number: a runtime input, read per call
        torch.testing.assert_close(na.add(nb, alpha=alpha).cpu(), a.add(b, alpha=alpha))
    c = torch.randn(8, 4)  # new data, same key
    torch.testing.assert_close(torch.sum(c.neuron() * nb, [1], keepdim=True).cpu(),
                               torch.sum(c * b, [1], keepdim=True), rtol=1e-5, atol=1e-5)
    assert _cached_launches() - before == 4
    # Another dim list is another executable, not the remembered one.
    torch.testing.assert_close(torch.sum(na * nb, [0]).cpu(), torch.sum(a * b, [0]), rtol=1e-5, atol=1e-5)


def test_cheap_key_leaves_aliasing_written_views_and_host_arguments_to_the_full_path():
    x, y = torch.randn(16), torch.randn(16)
    nx, ny = x.clone().neuron(), y.neuron()
    nx.add_(ny)  # remembered: writes its first argument
    x.add_(y)
    before = _cached_launches()
    nx.add_(nx)  # same key, but the op would read what it writes: not launched by key
    x.add_(x)
    torch.testing.assert_close(nx.cpu(), x)
    assert _cached_launches() == before
    m = torch.randn(4, 8)
    nm = m.neuron()
    for _ in range(2):  # a view the op writes: the full path checks it each call
        nm.t().mul_(2)
        m.t().mul_(2)
    torch.testing.assert_close(nm.cpu(), m)
    assert _cached_launches() == before
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        ny * torch.randn(16)  # same shapes as a remembered call, a host tensor: refused


def test_strided_views_launch_by_cheap_key_at_their_own_offsets():
    m = torch.randn(6, 40)
    nm = m.neuron()
    (nm[1:, 3:].t() * 2).cpu()
    before = _cached_launches()
    for start in (1, 2):  # another offset in the same storage: same key only if the span matches
        torch.testing.assert_close((nm[start:start + 5, 3:].t() * 2).cpu(), m[start:start + 5, 3:].t() * 2)
    other = torch.randn(6, 40)
    torch.testing.assert_close((other.neuron()[1:, 3:].t() * 2).cpu(), other[1:, 3:].t() * 2)
    assert _cached_launches() > before


def test_allocator_reuses_freed_blocks_and_empty_cache_releases_them():
    torch.neuron.empty_cache()
    base = torch.neuron.memory_allocated()
    x = torch.empty(1000, device="neuron")
    address = x.data_ptr()
    del x
    assert torch.neuron.memory_allocated() == base
    assert torch.neuron.memory_reserved() >= base + 4000  # kept for reuse
    y = torch.empty(1000, device="neuron")
    assert y.data_ptr() == address  # the same block again
    del y
    torch.neuron.empty_cache()
    assert torch.neuron.memory_reserved() == torch.neuron.memory_allocated() == base
    big = torch.empty(1 << 19, device="neuron")  # 2 MiB: never kept
    del big
    assert torch.neuron.memory_reserved() == base


def test_small_launches_run_inline_after_queued_large_ones():
    torch.manual_seed(0)
    queue = device_queue(0)
    assert queue.inline is not None  # the CPU task pool has an inline lane
    a = torch.randn(512, 512) / 16
    n = a.neuron()
    torch.neuron.synchronize()
    task, inline = queue.task.launches, queue.inline.launches
    big = torch.tanh(n @ n)  # 262144 elements: queued on the task pool
    small = big[:4, :8].contiguous() * 2  # reads what the task pool writes: runs inline, after it
    again = big + small.sum()  # and the task pool reads what ran inline
    expected_big = torch.tanh(a @ a)
    expected_small = expected_big[:4, :8] * 2
    torch.testing.assert_close(small.cpu(), expected_small, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(again.cpu(), expected_big + expected_small.sum(), rtol=1e-4, atol=1e-4)
    assert queue.task.launches - task >= 3 and queue.inline.launches - inline >= 3
    torchneuron.config.set(inline_elements=0)  # every launch on the task pool
    inline = queue.inline.launches
    torch.testing.assert_close((n[:2] * 3).cpu(), a[:2] * 3)
    assert queue.inline.launches == inline
