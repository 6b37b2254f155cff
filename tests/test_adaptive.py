"""Adaptive eager mode: ops recorded into graphs, fused executables built in
the background, op-by-op execution meanwhile (issue: adaptive eager mode)."""

import os
import subprocess
import sys

import pytest
import torch

import torchneuron
from torchneuron.adaptive import executor, recorder
from torchneuron.lowering import NotCompilable
from torchneuron.runtime import NeuronAsyncError


@pytest.fixture
def adaptive():
    torchneuron.config.set(compile_wait=False)  # the suite's op mode waits; adaptive never does
    with torchneuron.eager_mode("adaptive"):
        yield
    torchneuron.reset_stats()


def _meet_once(calls) -> None:
    """Run calls once and let them finish: a call met for the first time runs
    at once on the host, and is recorded from its second meeting on."""
    calls()
    torch.neuron.synchronize()


def _fused_ops() -> int:
    return torchneuron.adaptive_stats()["ops_fused"]


def _step(x, w, b):
    """A small block with views, in-place ops, a reduction and an intermediate
    the program drops."""
    h = torch.nn.functional.linear(x, w, b)
    h = torch.nn.functional.gelu(h)
    h[:, :2].mul_(0.5)
    t = h.t().contiguous()
    t.add_(1.0)
    return (t.sum(0) * 2).softmax(0), h


def test_switch_context_manager_and_setting():
    assert torchneuron.get_eager_mode() in ("op", "adaptive")
    with torchneuron.eager_mode("adaptive"):
        assert torchneuron.get_eager_mode() == "adaptive"
        assert torchneuron.config.settings.eager_mode == "adaptive"
        with torchneuron.eager_mode("op"):
            assert torchneuron.get_eager_mode() == "op"
        assert torchneuron.get_eager_mode() == "adaptive"
    with pytest.raises(ValueError, match="eager_mode"):
        torchneuron.set_eager_mode("fast")
    out = subprocess.run(
        [sys.executable, "-c", "import torchneuron; print(torchneuron.get_eager_mode())"],
        env=dict(os.environ, TORCHNEURON_EAGER_MODE="adaptive"), capture_output=True, text=True, check=True,
    )
    assert out.stdout.strip() == "adaptive"


def test_results_and_arguments_match_cpu_in_every_tier(adaptive):
    torch.manual_seed(0)
    x, w, b = torch.randn(4, 6), torch.randn(5, 6), torch.randn(5)
    args = [t.to("neuron") for t in (x, w, b)]
    expected = _step(x, w, b)
    before = [t.cpu() for t in args]
    fused_before = _fused_ops()
    # op by op (host or per-op executables): calls met once, then graphs met
    # once, then while the graphs compile
    for _ in range(3):
        first = _step(*args)
        for got, want in zip(first, expected):
            torch.testing.assert_close(got.cpu(), want)
        del first
    assert torchneuron.wait_for_compiles(timeout=600)
    again = _step(*args)  # the fused executable
    for got, want in zip(again, expected):
        torch.testing.assert_close(got.cpu(), want)
    assert _fused_ops() > fused_before
    for arg, saved in zip(args, before):  # arguments are untouched
        assert torch.equal(arg.cpu(), saved)


def test_results_are_ordinary_tensors_before_the_cut(adaptive):
    x = torch.arange(12.0).reshape(3, 4).to("neuron")
    y = x * 2  # recorded, not run
    assert y.device.type == "neuron" and y.shape == (3, 4) and y.data_ptr() != 0
    v = y[1:]  # a view of a pending result
    assert v.data_ptr() == y.data_ptr() + 4 * y.element_size()
    v.add_(100)  # in place through the view: lands in y's storage
    assert y._version == v._version
    torch.testing.assert_close(y.cpu(), torch.cat([torch.arange(4.0) * 2, torch.arange(4.0, 12) * 2 + 100]).reshape(3, 4))


def test_dead_intermediates_are_not_written(adaptive):
    x = torch.randn(64, 64).to("neuron")
    for _ in range(3):  # calls met, graph met, graph built
        out = ((x * 2).exp() + 1).sum()  # two 64x64 intermediates die before the read
        value = out.item()
        torchneuron.wait_for_compiles(timeout=600)
    before = torchneuron.adaptive_stats()["bytes_not_written"]
    out = ((x * 2).exp() + 1).sum()
    assert out.item() == pytest.approx(value, rel=1e-5)
    assert torchneuron.adaptive_stats()["bytes_not_written"] - before >= 2 * 64 * 64 * 4


def test_a_dropped_result_frees_its_memory_before_the_cut(adaptive):
    """As in op mode: the graph holds its own results only weakly, so peak
    memory does not grow with the ops a graph has recorded."""
    x = torch.randn(256, 256).to("neuron")
    _meet_once(lambda: (x * 2).exp())
    assert recorder.pending_graph(0) is None or not recorder.pending_graph(0).ops
    y = x * 2
    z = y.exp()
    held = torch.neuron.memory_allocated()
    del y  # dropped while its graph is still being recorded
    assert torch.neuron.memory_allocated() <= held - 256 * 256 * 4
    assert recorder.pending_graph(0) is not None and len(recorder.pending_graph(0).ops) == 2
    torch.testing.assert_close(z.cpu(), (x.cpu() * 2).exp())


def test_new_memory_where_a_dropped_result_was_is_a_new_input(adaptive):
    """A tensor allocated outside recording (torch.empty) may get the memory
    of a result the program dropped; the graph must read the new tensor."""
    x = torch.randn(33, 17)
    xn = x.to("neuron")
    reused = []
    for _ in range(3):  # op by op, then fused
        a = xn * 3
        address = a.data_ptr()
        b = a + 1
        del a
        fresh = torch.empty(33, 17, device="neuron")  # the allocator hands out the block just freed
        reused.append(fresh.data_ptr() == address)
        fresh.fill_(-2.0)
        c = b + fresh
        torch.testing.assert_close(c.cpu(), x * 3 + 1 - 2)
        torch.testing.assert_close(fresh.cpu(), torch.full((33, 17), -2.0))  # written where it is
        torch.testing.assert_close(xn.cpu(), x)
        torchneuron.wait_for_compiles(timeout=600)
    assert any(reused)  # the case under test happened


def test_a_split_graph_keeps_a_dropped_result_its_second_part_reads(adaptive):
    """A loop's graph is split where an iteration begins again; a result of
    the first part that the program dropped but the second part reads still
    reaches it."""
    x = torch.randn(9, 7)
    xn = x.to("neuron")
    _meet_once(lambda: (lambda b: b * b)(xn * 3 + 1))
    for _ in range(3):  # op by op, then fused
        torch.neuron.synchronize()
        a = xn * 3
        b = a + 1  # reads a
        c = b * b
        del a
        graph = recorder._pending.pop(0)
        head, tail = graph.split(1)  # tail's first op reads head's dropped result
        executor.cut(head, "loop")
        executor.cut(tail, "loop")
        torch.testing.assert_close(b.cpu(), x * 3 + 1)
        torch.testing.assert_close(c.cpu(), (x * 3 + 1) ** 2)
        torchneuron.wait_for_compiles(timeout=600)
    assert torchneuron.adaptive_stats()["launches"]["fused"] >= 2


def test_graphs_are_the_same_from_one_iteration_to_the_next(adaptive):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)).to("neuron")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8).to("neuron")

    def step(lr):
        for group in opt.param_groups:
            group["lr"] = lr  # a value that changes: a runtime input, not a new graph
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()

    step(0.1)  # calls met once
    step(0.095)  # graphs met once
    step(0.09)  # graphs built
    torchneuron.wait_for_compiles(timeout=600)
    known = executor.graph_count()
    fused = _fused_ops()
    for i in range(3):
        step(0.08 - 0.01 * i)
    assert executor.graph_count() == known  # no new graphs
    assert _fused_ops() > fused


def test_training_matches_op_mode_and_cpu(adaptive):
    from torchneuron.models import GPTConfig, train_gpt

    cfg = GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=16)
    cpu = train_gpt("cpu", 4, cfg=cfg)
    neuron = train_gpt("neuron", 4, cfg=cfg)  # dropout included: masks come from the same generator
    torch.testing.assert_close(torch.tensor(neuron), torch.tensor(cpu), rtol=1e-4, atol=1e-4)


def test_host_read_in_the_middle_of_a_loop(adaptive):
    x = torch.zeros(8).to("neuron")
    seen = []
    for i in range(5):
        x = x + 1
        if i == 2:
            seen.append(x[3].item())  # cuts the graph here
        x = x * 1
    assert seen == [3.0]
    assert torch.equal(x.cpu(), torch.full((8,), 5.0))
    assert torchneuron.adaptive_stats()["cut_reasons"].get("sync", 0) >= 2


def test_out_of_range_index_in_a_fused_graph_names_the_line(adaptive):
    table = torch.randn(10, 4).to("neuron")

    def lookup(ids):
        return (torch.nn.functional.embedding(ids, table) * 2).sum(1)

    good = torch.tensor([1, 2]).to("neuron")
    lookup(good).cpu()
    torchneuron.wait_for_compiles(timeout=600)
    lookup(good).cpu()  # now fused
    bad = torch.tensor([1, 12]).to("neuron")
    result = lookup(bad)  # the line the error must name is inside lookup
    with pytest.raises(NeuronAsyncError, match=r"embedding.*test_adaptive.py:\d+.*out of range"):
        torch.neuron.synchronize()
    del result


def test_graph_that_fails_to_compile_gives_the_same_results(adaptive, monkeypatch):
    def refuse(spec, floats, ints):
        raise NotCompilable("forced by the test")

    monkeypatch.setattr(executor, "lower_graph_elsewhere", refuse)
    x = torch.randn(6, 5)
    xn = x.to("neuron")
    expected = (x.exp() * 3 - 1).tanh().sum(0)
    for _ in range(3):
        got = (xn.exp() * 3 - 1).tanh().sum(0)
        torchneuron.wait_for_compiles(timeout=600)
        torch.testing.assert_close(got.cpu(), expected)
    bad = [g for g in executor._fused.values() if "forced by the test" in g.reason]
    assert bad and all(all(u.executable is None for u in g.units) for g in bad)


def test_the_fallback_policy_applies_to_ops_of_a_graph_the_compiler_declines(adaptive):
    """linalg.inv of a 40x40 matrix stays on the host: inside an adaptive
    graph it is a host fallback as in op mode (counted, warned, or refused)."""
    torchneuron.config.set(compile_wait=True)
    a = torch.randn(40, 40) + 40 * torch.eye(40)
    an = a.to("neuron")
    torchneuron.config.set(fallback="error")
    with pytest.raises(torchneuron.FallbackError, match=r"aten\.linalg_inv_ex\.default would run on the host"):
        torch.linalg.inv(an * 2).cpu()
    torchneuron.config.set(fallback="allow")
    before = torchneuron.fallback_ops().get("aten.linalg_inv_ex.default", 0)
    got = torch.linalg.inv(an * 3).cpu()
    torch.testing.assert_close(got, torch.linalg.inv(a * 3))
    assert torchneuron.fallback_ops().get("aten.linalg_inv_ex.default", 0) == before + 1
    torch.testing.assert_close(an.cpu(), a, rtol=0, atol=0)


def test_compile_wait_runs_fused_from_the_first_occurrence(adaptive):
    torchneuron.config.set(compile_wait=True)
    x = torch.randn(7, 3).to("neuron")
    fused = _fused_ops()
    y = (x.sin() * x.cos() + 0.25).abs().sum().item()
    assert _fused_ops() > fused
    assert y == pytest.approx((x.cpu().sin() * x.cpu().cos() + 0.25).abs().sum().item(), rel=1e-5)


def test_random_ops_keep_their_graph_and_match_cpu(adaptive):
    x = torch.randn(32, 16)
    torch.manual_seed(3)
    cpu = torch.nn.functional.dropout(x * 2, p=0.25, training=True) + torch.rand(32, 16)
    torch.manual_seed(3)
    before = torchneuron.fallback_ops().get("aten.native_dropout.default", 0)
    got = torch.nn.functional.dropout(x.to("neuron") * 2, p=0.25, training=True) + torch.rand(32, 16, device="neuron")
    torch.testing.assert_close(got.cpu(), cpu)
    assert torchneuron.fallback_ops().get("aten.native_dropout.default", 0) == before


def test_native_dropout_returns_cpus_output_and_bool_mask(adaptive):
    x = torch.randn(8, 32, 16)
    torch.manual_seed(5)
    cpu_out, cpu_mask = torch.ops.aten.native_dropout(x, 0.3, True)
    torch.manual_seed(5)
    xn = x.to("neuron")
    out, mask = torch.ops.aten.native_dropout(xn, 0.3, True)
    assert mask.dtype == cpu_mask.dtype == torch.bool
    torch.testing.assert_close(out.cpu(), cpu_out)
    assert torch.equal(mask.cpu(), cpu_mask)
    assert torch.equal(xn.cpu(), x)


def _dropout_loop(xs, device, steps, between=None):
    """A loop's sequence of dropout masks (two sizes, seven masks a step, as
    the demo's); `between(step)` may draw or reseed in the middle of a step."""
    xs = [x.to(device) for x in xs]
    outs = []
    for step in range(steps):
        for k, i in enumerate((0, 1, 0, 0, 1, 0, 0)):
            outs.append(torch.nn.functional.dropout(xs[i], p=0.1, training=True))
            if between is not None and k == 3:
                outs.extend(between(step, device))
    return [o.cpu() for o in outs]


def _interrupt(step, device):
    """Other draws and a reseed the draws ahead did not foresee."""
    if step == 3:
        return [torch.rand(5, device=device)]
    if step == 5:
        torch.manual_seed(11)
    if step == 6:
        return [torch.nn.functional.dropout(torch.ones(3, 3, device=device), p=0.5, training=True)]
    return []


@pytest.mark.parametrize("between", [None, _interrupt], ids=["loop", "interrupted"])
def test_dropout_masks_drawn_ahead_are_cpus_masks(adaptive, between):
    """Masks drawn ahead on the drawing thread (dispatch/draws_ahead.py) are
    used only when the generator is where they were drawn from: every mask,
    and every draw after one, equals CPU's, also when the loop is
    interrupted by draws and a reseed it did not foresee."""
    from torchneuron.dispatch import draws_ahead

    draws_ahead.forget()
    xs = [torch.randn(8, 32, 16), torch.randn(8, 4, 8, 8)]
    torch.manual_seed(7)
    cpu = _dropout_loop(xs, "cpu", 9, between)
    cpu_after = torch.rand(4)
    torch.manual_seed(7)
    before = dict(draws_ahead.counts)
    got = _dropout_loop(xs, "neuron", 9, between)
    got_after = torch.rand(4, device="neuron").cpu()
    assert len(got) == len(cpu)
    for g, c in zip(got, cpu):
        assert torch.equal(g, c)
    assert torch.equal(got_after, cpu_after)
    # The loop's masks were drawn ahead after its first steps.
    assert draws_ahead.counts["ahead"] - before["ahead"] >= 30


def test_a_fused_graph_runs_beside_the_program_unless_tiny(adaptive):
    """A graph touching many elements launches on the device's worker threads
    (the program records the next one meanwhile); a tiny one runs inline."""
    from torchneuron.runtime import device_queue

    torchneuron.config.set(compile_wait=True)

    def block(x):
        for _ in range(6):
            x = torch.tanh(x * 1.5 + 0.25)
        return x

    queue = device_queue(0)
    for shape, inline in (((4, 4), True), ((256, 256), False)):
        x = torch.randn(*shape).to("neuron")
        for _ in range(2):
            block(x)
            torch.neuron.synchronize()
        task, fused = queue.task.launches, _fused_ops()
        y = block(x)
        torch.neuron.synchronize()
        assert _fused_ops() > fused
        assert (queue.task.launches == task) == inline
        torch.testing.assert_close(y.cpu(), block(x.cpu()))


def test_a_restarted_process_compiles_nothing(tmp_path):
    script = (
        "import torch, torchneuron\n"
        "torchneuron.set_eager_mode('adaptive')\n"
        "x = torch.arange(20.0).to('neuron')\n"
        "for _ in range(2):\n"
        "    y = ((x * 3).sin() + x).sum().item()\n"
        "    torchneuron.wait_for_compiles(timeout=600)\n"
        "s = torchneuron.adaptive_stats()\n"
        "print(torchneuron.compile_stats()['compiles'], s['graphs_compiled'], s['ops_fused'] > 0)\n"
    )
    env = dict(os.environ, TORCHNEURON_CACHE_DIR=str(tmp_path / "cache"), TORCHNEURON_COMPILE_WAIT="1")
    first = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    second = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    compiles, graphs, fused = first.stdout.split()
    assert int(compiles) >= 1 and int(graphs) >= 1 and fused == "True"
    compiles, graphs, fused = second.stdout.split()
    assert int(compiles) == 0 and int(graphs) >= 1 and fused == "True"


def test_recording_is_cut_by_ops_it_cannot_record(adaptive):
    x = torch.tensor([0.0, 2.0, 0.0, 3.0]).to("neuron")
    _meet_once(lambda: torch.nonzero(x * 2))
    y = x * 2
    idx = torch.nonzero(y)  # a data-dependent shape: runs after everything recorded before it
    assert idx.cpu().flatten().tolist() == [1, 3]
    reasons = torchneuron.adaptive_stats()["cut_reasons"]
    assert any(r.startswith("unrecordable: aten.nonzero") for r in reasons)


def test_size_cap_cuts_long_chains(adaptive):
    torchneuron.config.set(adaptive_max_ops=8)
    x = torch.zeros(4).to("neuron")
    for _ in range(20):
        x = x + 1
    assert torch.equal(x.cpu(), torch.full((4,), 20.0))
    assert torchneuron.adaptive_stats()["cut_reasons"].get("size", 0) >= 2
    assert recorder.pending_graph(0) is None


@pytest.mark.parametrize("held_kb", [-1, 64])
def test_a_graph_holding_inputs_the_program_dropped_is_cut_past_the_setting(adaptive, held_kb):
    # (peak cuts off: one learned here by the other parameter's run would cut
    # this graph at the same place for the other reason)
    torchneuron.config.set(adaptive_held_kb=held_kb, adaptive_peak_cuts=False)
    x_cpu = torch.randn(32768)  # 128 KiB
    _meet_once(lambda: x_cpu.to("neuron") * 2 + 1)
    held_cuts = torchneuron.adaptive_stats()["cut_reasons"].get("inputs held", 0)
    base = torch.neuron.memory_allocated()
    x = x_cpu.to("neuron")
    torch.neuron.synchronize()
    y = x * 2
    del x  # only the pending graph holds its memory now
    z = y + 1
    allocated = torch.neuron.memory_allocated()
    cuts = torchneuron.adaptive_stats()["cut_reasons"].get("inputs held", 0) - held_cuts
    if held_kb >= 0:
        assert cuts == 1 and recorder.pending_graph(0) is None
    else:
        assert cuts == 0 and len(recorder.pending_graph(0).ops) == 2
    torch.testing.assert_close(z.cpu(), x_cpu * 2 + 1)
    torch.testing.assert_close(y.cpu(), x_cpu * 2)
    # Cut and run, the graph let go of x's memory; uncut, it still holds it.
    # (within a few bytes: the warm-up's one-element scalars may go in between)
    assert abs(allocated - base - (2 if held_kb >= 0 else 3) * 32768 * 4) < 1024


def _dropped_input_step(src):
    """An input the program drops early in a graph, then a new peak."""
    x = src * 1.0
    torch.neuron.synchronize()  # x exists before the next graph: an input of it
    s = x.sum()
    del x  # op mode frees it now; a pending graph still holds it
    y = src * 3.0
    z = y + s
    return (z * 2).amax()


def _step_peak(step, src) -> int:
    torch.neuron.synchronize()
    torch.neuron.reset_peak_memory_stats()
    step(src)
    torch.neuron.synchronize()
    return torch.neuron.max_memory_allocated()


@pytest.mark.parametrize("peak_cuts", [True, False])
def test_inputs_the_program_dropped_do_not_lift_the_peak_past_op_modes(adaptive, peak_cuts):
    # Launches and compiles finish in order, so memory levels do not depend on timing.
    torchneuron.config.set(launch_blocking=True, compile_wait=True, adaptive_peak_cuts=peak_cuts)
    recorder.reset()
    src = torch.randint(-8, 8, (65536,)).float().to("neuron")  # 256 KiB, sums exact
    with torchneuron.eager_mode("op"):
        expected = _dropped_input_step(src.cpu())
        op_peak = max(_step_peak(_dropped_input_step, src) for _ in range(2))
    peaks = [_step_peak(_dropped_input_step, src) for _ in range(4)]
    cuts = torchneuron.adaptive_stats()["cut_reasons"].get("memory peak", 0)
    torch.testing.assert_close(_dropped_input_step(src).cpu(), expected)
    if peak_cuts:
        # Learned in the first iteration, cut from the second on.
        assert cuts >= 2 and peaks[-1] <= op_peak and peaks[-2] <= op_peak
    else:
        # (within a few bytes: launches' runtime numbers are device memory too)
        assert cuts == 0 and peaks[-1] >= op_peak + 65536 * 4 - 1024


@pytest.mark.parametrize("bad", [-2, 1.5, "64"])
def test_adaptive_held_kb_refuses_what_is_not_an_integer_from_minus_one(bad):
    before = torchneuron.config.settings.adaptive_held_kb
    with pytest.raises(ValueError, match="adaptive_held_kb"):
        torchneuron.config.set(adaptive_held_kb=bad)
    assert torchneuron.config.settings.adaptive_held_kb == before


def test_a_dead_lowering_worker_is_replaced(adaptive):
    from torchneuron.lowering import worker

    x = torch.randn(9).to("neuron")
    (x.sin() + 1).sum().item()
    assert torchneuron.wait_for_compiles(timeout=600)
    if worker._worker is not None:  # kill the worker the first graph started
        worker._worker.process.kill()
        worker._worker.process.wait()
    fused = _fused_ops()
    for _ in range(4):  # a new graph: built by a new worker at its second meeting
        got = (x.cos() * 3).amax().item()
        torchneuron.wait_for_compiles(timeout=600)
    assert got == pytest.approx((x.cpu().cos() * 3).amax().item(), rel=1e-6)
    assert _fused_ops() > fused


def test_an_op_found_to_need_constant_scalars_is_remembered_across_processes(tmp_path):
    """masked_fill with an integer fill value cannot take it as a runtime scalar
    inside a fused graph (the importer has no sym_float): the first process
    finds that by probing, after a build that compiled the graph only in
    segments; a later process makes it a constant from the first recording,
    so its graph compiles whole at once."""
    script = (
        "import torch, torchneuron\n"
        "from torchneuron.adaptive import recorder\n"
        "recorder._BAKED_NAMES = frozenset()  # found by probing, not from the built-in list\n"
        "torchneuron.set_eager_mode('adaptive')\n"
        "x = torch.arange(20.0).to('neuron')\n"
        "m = (torch.arange(20) % 3 == 0).to('neuron')\n"
        "for _ in range(3):\n"
        "    y = ((x * 2).masked_fill(m, 0) + x).sum().item()\n"
        "    torchneuron.wait_for_compiles(timeout=600)\n"
        "s = torchneuron.adaptive_stats()\n"
        "print(y, [str(o) for o in recorder._baked], s['graphs_compiled'], s['graphs_segmented'])\n"
    )
    env = dict(os.environ, TORCHNEURON_CACHE_DIR=str(tmp_path / "cache"), TORCHNEURON_COMPILE_WAIT="1")
    runs = [subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
            for _ in range(2)]
    expected = ((torch.arange(20.0) * 2).masked_fill(torch.arange(20) % 3 == 0, 0) + torch.arange(20.0)).sum().item()
    first, second = (r.stdout.strip() for r in runs)
    assert first == f"{expected} ['aten.masked_fill.Scalar'] 1 1"
    assert second == f"{expected} ['aten.masked_fill.Scalar'] 1 0"


def test_a_call_met_for_the_first_time_runs_at_once_and_is_recorded_from_the_second(adaptive):
    """Building a call's recipe (meta kernels) costs more than running it on
    the host, and a program's setup meets most calls once."""
    x = torch.randn(6, 5)
    xn = x.to("neuron")
    torch.neuron.synchronize()
    recorder.reset()  # every call new again (other tests met these)
    before = torchneuron.adaptive_stats()["ops_recorded"]
    y = xn.sin() * 3  # both met for the first time: nothing recorded, no graph pending
    assert recorder.pending_graph(0) is None or not recorder.pending_graph(0).ops
    torch.testing.assert_close(y.cpu(), x.sin() * 3)
    z = xn.sin() * 3  # the second meeting: recorded
    assert len(recorder.pending_graph(0).ops) == 2
    torch.testing.assert_close(z.cpu(), x.sin() * 3)
    assert torchneuron.adaptive_stats()["ops_recorded"] - before == 2
    torchneuron.config.set(compile_wait=True)  # waiting for every compile: recorded from the first meeting
    w = xn.cos() + 1
    assert len(recorder.pending_graph(0).ops) == 2
    torch.testing.assert_close(w.cpu(), x.cos() + 1)


def test_bfloat16_ops_in_a_fused_graph_round_as_each_op_alone(adaptive):
    """IREE computes a fused chain of bfloat16 ops in float32 without
    rounding between them; each op's result is rounded as stored, so the
    graph gives CPU's bits, wherever it was cut."""
    torchneuron.config.set(compile_wait=True)
    torch.manual_seed(0)
    x, w = torch.randn(64, 33).bfloat16(), torch.randn(64, 33).bfloat16()

    def chain(a, b):
        y = a * b + a
        y = y * 1.7 - b
        return (y * y).tanh() + y / 3

    fused = _fused_ops()
    got = chain(x.to("neuron"), w.to("neuron")).cpu()
    assert _fused_ops() >= fused + 6
    assert torch.equal(got, chain(x, w))


def test_pow_of_negative_bases_in_a_fused_graph(adaptive):
    """pow's exponent is a constant of the graph (as in op mode): a runtime
    exponent lowers to exp(y * log(x)), NaN where x < 0."""
    torchneuron.config.set(compile_wait=True)
    x = torch.linspace(-3, 3, 128).reshape(1, 128, 1)
    fused = _fused_ops()
    got = (torch.pow(x.to("neuron"), 3) + torch.pow(x.to("neuron") * 2, 2)).cpu()
    assert _fused_ops() > fused
    torch.testing.assert_close(got, torch.pow(x, 3) + torch.pow(x * 2, 2))
