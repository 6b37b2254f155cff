"""The discrete memory model (TORCHNEURON_MEMORY=discrete on the CPU driver):
storages are device buffers the host reaches only through counted transfers.

The memory model is fixed once a device allocated, so each test runs its
program in a child process under the discrete model and checks what it
reports (values are compared against PyTorch CPU there). The suite's
device, copy, view, autograd and error tests also run whole under it
(Makefile: DISCRETE_TESTS)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap


def _run_discrete(body: str, **env) -> dict:
    """Run `body` (which sets `result`, a JSON-able dict) under the discrete model."""
    code = (
        "import json, torch, torchneuron\n"
        "from torchneuron import _C\n"
        "result = {}\n" + textwrap.dedent(body) + "\nprint('RESULT' + json.dumps(result))\n"
    )
    environment = dict(os.environ, TORCHNEURON_MEMORY="discrete", TORCHNEURON_COMPILE_WAIT="1",
                       TORCHNEURON_EAGER_MODE="op", **env)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT")][-1]
    return json.loads(line[len("RESULT"):])


def test_storages_have_opaque_device_addresses_the_host_cannot_use():
    result = _run_discrete("""
        a = torch.arange(12.0).to("neuron")
        b = a[3:]
        result["model"] = torchneuron.transfer_stats()["memory_model"]
        result["discrete"] = _C.discrete_memory()
        result["view_offset"] = b.data_ptr() - a.data_ptr()
        result["stable"] = a.data_ptr() == a.untyped_storage().data_ptr()
        c = torch.empty(5, device="neuron")
        result["distinct"] = c.data_ptr() != a.data_ptr()
        try:
            _C.host_alias(a)
        except RuntimeError as e:
            result["refused"] = str(e)
        """)
    assert result["model"] == "discrete" and result["discrete"]
    assert result["view_offset"] == 3 * 4 and result["stable"] and result["distinct"]
    assert "cannot read or write neuron:0's memory in place" in result["refused"]


def test_values_views_and_in_place_ops_match_cpu():
    result = _run_discrete("""
        x = torch.randn(6, 7)
        n = x.to("neuron")
        checks = {}
        checks["ops"] = torch.allclose((n * 2 + 1).exp().cpu(), (x * 2 + 1).exp())
        checks["matmul"] = torch.allclose((n @ n.t()).cpu(), x @ x.t(), atol=1e-5)
        checks["item"] = abs(n.sum().item() - x.sum().item()) < 1e-4
        checks["tolist"] = n[0].tolist() == x[0].tolist()
        checks["strided_view"] = torch.equal(n[1:5:2, ::3].cpu(), x[1:5:2, ::3])
        checks["transpose_copy"] = torch.equal(n.t().contiguous().cpu(), x.t().contiguous())
        y, m = x.clone(), n.clone()
        for t in (y, m):
            t[1, 2:4] = 3.0
            t[:, 0] += 1
            t[t > 2] = -1
            t.t()[2].mul_(5)
        checks["in_place"] = torch.equal(m.cpu(), y)
        # A CPU tensor copied into a strided neuron view keeps the bytes around it.
        z = torch.zeros(4, 4, device="neuron")
        z[:, 1] = torch.arange(4.0)
        expected = torch.zeros(4, 4)
        expected[:, 1] = torch.arange(4.0)
        checks["copy_into_view"] = torch.equal(z.cpu(), expected)
        r = torch.arange(6.0, device="neuron")
        r.resize_(4, 4)
        checks["resize_keeps"] = torch.equal(r.view(-1)[:6].cpu(), torch.arange(6.0))
        checks["print"] = "tensor(" in repr(n[0])
        result.update(checks)
        """)
    assert all(result.values()), result


def test_transfers_are_what_the_program_asks_for():
    result = _run_discrete("""
        x = torch.randn(256)
        n = x.to("neuron")
        torch.neuron.synchronize()
        torchneuron.reset_transfer_stats()
        y = n.to("neuron")  # already there: nothing moves
        s = (n * 3).exp().sum()  # compiled ops: nothing moves
        torch.neuron.synchronize()
        result["compiled"] = torchneuron.transfer_stats()
        torchneuron.reset_transfer_stats()
        s.item()
        result["item"] = torchneuron.transfer_stats()
        torchneuron.reset_transfer_stats()
        n.to("neuron", copy=True)
        torch.ones(1000).to("neuron")
        result["to_device"] = torchneuron.transfer_stats()
        torchneuron.reset_transfer_stats()
        n[10:20].cpu()
        result["slice_to_host"] = torchneuron.transfer_stats()
        """)
    compiled = result["compiled"]
    assert compiled["host_to_device"] == 0 and compiled["device_to_host"] == 0, compiled
    assert result["item"]["device_to_host"] == 4 and result["item"]["host_to_device"] == 0, result["item"]
    assert result["to_device"]["host_to_device"] == 4000, result["to_device"]
    assert result["slice_to_host"]["device_to_host"] == 40, result["slice_to_host"]


def test_host_path_ops_copy_their_operands_and_write_back():
    result = _run_discrete("""
        x = torch.randn(8, 8)
        n = x.to("neuron")
        m = n.clone()
        torch.neuron.synchronize()
        torchneuron.config.set(execution="host")  # every op on the host path
        torchneuron.reset_transfer_stats()
        q = torch.ops.aten.kthvalue.default(n, 3, 1)
        result["kthvalue"] = torchneuron.transfer_stats()
        ref = torch.ops.aten.kthvalue.default(x, 3, 1)
        result["values"] = torch.equal(q[0].cpu(), ref[0]) and torch.equal(q[1].cpu(), ref[1])
        # An in-place host op on a strided view: its bytes go out and come back.
        torchneuron.reset_transfer_stats()
        m[:, 2].mul_(3.0)
        result["in_place"] = torchneuron.transfer_stats()
        y = x.clone()
        y[:, 2].mul_(3.0)
        result["in_place_values"] = torch.equal(m.cpu(), y)
        """)
    assert result["values"] and result["in_place_values"], result
    # The operand out, the values (float32) and indices (int64) back; the
    # out= tensors the op fills are never read.
    assert result["kthvalue"]["device_to_host"] == 8 * 8 * 4, result
    assert result["kthvalue"]["host_to_device"] == 8 * 4 + 8 * 8, result
    # A column of an 8x8 matrix spans 7 rows and one element: 57 floats each way.
    assert result["in_place"]["device_to_host"] == 57 * 4 == result["in_place"]["host_to_device"], result


def test_training_steps_match_cpu():
    result = _run_discrete("""
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
        ref = __import__("copy").deepcopy(model)
        model.to("neuron")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        data, target = torch.randn(8, 16), torch.randn(8, 4)
        losses = []
        for _ in range(3):
            for m, o, d, t in ((model, opt, data.to("neuron"), target.to("neuron")), (ref, ref_opt, data, target)):
                o.zero_grad()
                loss = torch.nn.functional.mse_loss(m(d), t)
                loss.backward()
                o.step()
                losses.append(loss.item())
        result["losses"] = losses
        result["weights"] = max((p.detach().cpu() - q.detach()).abs().max().item()
                                for p, q in zip(model.parameters(), ref.parameters()))
        result["host_ops"] = torchneuron.execution_stats()["ops_on_host_fallback"]
        """)
    losses = result["losses"]
    assert all(abs(a - b) < 1e-4 for a, b in zip(losses[0::2], losses[1::2])), losses
    assert result["weights"] < 1e-4, result


def test_serialization_and_deepcopy_go_through_transfers():
    result = _run_discrete("""
        import copy, io, pickle
        x = torch.randn(3, 4)
        n = x.to("neuron")
        buf = io.BytesIO()
        torch.save({"w": n, "view": n[1:]}, buf)
        buf.seek(0)
        back = torch.load(buf)
        result["load_device"] = str(back["w"].device)
        result["load_values"] = torch.equal(back["w"].cpu(), x) and torch.equal(back["view"].cpu(), x[1:])
        buf.seek(0)
        result["map_location"] = torch.equal(torch.load(buf, map_location="cpu")["w"], x)
        result["deepcopy"] = torch.equal(copy.deepcopy(n).cpu(), x)
        result["pickle"] = torch.equal(pickle.loads(pickle.dumps(n)).cpu(), x)
        """)
    assert result.pop("load_device") == "neuron:0"
    assert all(result.values()), result


def test_memory_limit_is_clear_and_guards_can_be_turned_on_late():
    # Guarded memory (tests/test_memory_guards.py) turned on after tensors
    # exist: blocks made before stay unguarded, new ones are guarded.
    result = _run_discrete("""
        torchneuron.set_memory_limit(1 << 20)
        try:
            torch.empty(1 << 20, device="neuron")
        except torch.OutOfMemoryError as e:
            result["oom"] = str(e)
        x = torch.randn(32)
        before = x.to("neuron")
        torchneuron.config.set(check_memory=True)
        after = x.to("neuron")
        result["same"] = torch.equal((before + after).cpu(), x + x) and torch.equal(before.cpu(), x)
        torch.neuron.synchronize()
        result["guards_read"] = torchneuron.transfer_stats()["memory_guard_bytes"] > 0
        """)
    assert "neuron out of memory" in result["oom"] and "neuron:0" in result["oom"]
    assert result["same"] and result["guards_read"], result


def test_a_steady_training_step_moves_its_batch_loss_and_host_path_operands():
    # The demo's GPT (smaller): once every op is compiled, a step copies its
    # batch in, its loss out and, for each op on the host path (dropout, whose
    # masks come from PyTorch's CPU generator), its operands out and results
    # in. Nothing else crosses. The host-path bytes are tallied from the ops'
    # own arguments and results, apart from the transfer counters.
    result = _run_discrete("""
        from torchneuron.dispatch import host_fallback
        from torchneuron.models import GPTConfig, train_gpt
        per_step, tally = [], {"out": 0, "in": 0}
        run = host_fallback.run

        def neuron_bytes(value):
            if isinstance(value, torch.Tensor):
                return value.nbytes if value.device.type == "neuron" else 0
            if isinstance(value, (list, tuple)):
                return sum(neuron_bytes(v) for v in value)
            return 0

        copies = {"aten.copy_.default", "aten._copy_from.default", "aten._local_scalar_dense.default"}

        def tallied(op, info, args, kwargs, device):
            if info.name in copies:  # the batch and the loss: counted apart
                return run(op, info, args, kwargs, device)
            tally["out"] += neuron_bytes(list(args)) + neuron_bytes(list(kwargs.values()))
            results = run(op, info, args, kwargs, device)
            tally["in"] += neuron_bytes(results)
            return results

        host_fallback.run = tallied

        def on_step(step, loss):
            per_step.append(dict(torchneuron.transfer_stats(), host_out=tally["out"], host_in=tally["in"]))
            torchneuron.reset_transfer_stats()
            tally.update(out=0, **{"in": 0})

        cfg = GPTConfig(n_embd=32, n_layer=1, block_size=16)
        losses = train_gpt("neuron", 6, cfg=cfg, batch=4, on_step=on_step)
        cpu = train_gpt("cpu", 6, cfg=cfg, batch=4)
        result["steps"] = per_step
        result["losses"] = [losses, cpu]
        result["fallback"] = torchneuron.fallback_ops()
        """)
    losses, cpu = result["losses"]
    assert all(abs(a - b) < 1e-4 for a, b in zip(losses, cpu)), (losses, cpu)
    assert set(result["fallback"]) == {"aten.native_dropout.default"}, result["fallback"]
    batch_bytes = 2 * 4 * 16 * 8  # inputs and targets, int64
    for stats in result["steps"][2:]:
        assert stats["host_out"] > 0, stats
        assert stats["host_to_device"] == batch_bytes + stats["host_in"], stats
        # The loss, the host ops' operands, and the flags of index bound checks (embedding, loss targets).
        assert stats["device_to_host"] == 4 + stats["host_out"] + stats["index_check_bytes"], stats
        assert 0 < stats["index_check_bytes"] <= 8, stats
        assert stats["device_to_device"] == 0, stats


def test_pinned_memory_copies_are_queued_on_the_stream():
    result = _run_discrete("""
        x = torch.randn(1000)
        pinned = x.pin_memory()
        result["pinned"] = [pinned.is_pinned(), x.is_pinned(), torch.empty(3, pin_memory=True).is_pinned()]
        torchneuron.reset_transfer_stats()
        n = pinned.to("neuron", non_blocking=True)  # queued on the stream, not waited for
        queued = torchneuron.transfer_stats()["queued_copy_bytes"]
        result["to_device"] = torch.equal((n * 2).cpu(), x * 2)  # the launch after it on the stream sees it
        back = torch.empty(1000, pin_memory=True)
        back.copy_(n * 3, non_blocking=True)
        torch.neuron.current_stream().synchronize()
        result["to_host"] = torch.equal(back, x * 3)
        result["queued"] = [queued, torchneuron.transfer_stats()["queued_copy_bytes"]]
        # On a side stream, and an event orders the default stream after it.
        side = torch.neuron.Stream()
        with torch.neuron.stream(side):
            m = pinned.to("neuron", non_blocking=True)
            done = torch.neuron.Event()
            done.record()
        torch.neuron.current_stream().wait_event(done)
        result["side"] = torch.equal((m + 1).cpu(), x + 1)
        # Pageable memory: the ordinary, waited-for copy.
        before = torchneuron.transfer_stats()["queued_copy_bytes"]
        p = x.to("neuron", non_blocking=True)
        result["pageable"] = [torchneuron.transfer_stats()["queued_copy_bytes"] == before, torch.equal(p.cpu(), x)]
        # As on CUDA, a non_blocking copy to the CPU lands in pinned memory.
        c = n.to("cpu", non_blocking=True)
        torch.neuron.synchronize()
        result["to_cpu"] = [c.is_pinned(), torch.equal(c, x)]
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x.view(100, 10)), batch_size=25,
                                             pin_memory=True, pin_memory_device="neuron")
        batch = next(iter(loader))[0]
        result["loader"] = [batch.is_pinned(), torch.equal(batch.to("neuron", non_blocking=True).cpu(), x[:250].view(25, 10))]
        result["x"] = torch.equal(x, pinned)  # the source is unchanged
        """)
    assert result["pinned"] == [True, False, True]
    assert result["to_device"] and result["to_host"] and result["side"] and result["x"], result
    assert result["queued"] == [4000, 8000], result  # the two pinned copies, queued without a wait
    assert result["pageable"] == [True, True]
    assert result["to_cpu"] == [True, True] and result["loader"] == [True, True], result
