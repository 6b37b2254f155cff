"""Guarded memory (TORCHNEURON_CHECK_MEMORY=1, issue 11): a write outside the
memory an op owns is raised naming the op, its shapes and the source line,
never a later crash. Each case runs in its own process: the guards are set
before the first allocation. On the discrete memory model (issue 48) the
guards are device memory, written and read with transfers."""

import os

import pytest

from test_persistent_cache import run_python

MODELS = ["unified", "discrete"]

# After a stale write: the next synchronization reports it, once, and the
# device stays usable.
_SYNC_THEN_USE = """
        try:
            torch.neuron.synchronize()
        except NeuronMemoryError as e:
            print("ERROR", e)
        x = torch.ones(4, device="neuron") * 3
        print("AFTER", x.sum().item())
"""

_GUARDED = {"TORCHNEURON_CHECK_MEMORY": "1"}


def _cache():
    return os.environ["TORCHNEURON_CACHE_DIR"]


@pytest.mark.parametrize("memory", MODELS)
def test_an_executable_writing_past_its_tensor_is_named(memory):
    """A real executable (zero_ on 32 floats) launched over a 16-float tensor,
    as a miscompiled op would write: the launch is named with its source line."""
    code = """
        import torch, torchneuron
        from torchneuron.compiler import compile_mlir
        from torchneuron.dispatch.op_info import op_info
        from torchneuron.lowering import lower_call, signature_of
        from torchneuron.runtime import LoadedExecutable, device_queue
        from torchneuron.runtime.memory_guards import NeuronMemoryError

        op = torch.ops.aten.zero_.default
        info = op_info(op)
        big = torch.ones(32, device="neuron")
        mlir = lower_call(op, info, signature_of(op, info, (big,), {})).mlir
        exe = LoadedExecutable(compile_mlir(mlir, "zero_")[0], "test", "aten.zero_.default(float32[32])")
        small = torch.ones(16, device="neuron")
        before = torch.ones(8, device="neuron")
        queue = device_queue(0)
        view = queue.task.import_memory(small, 0, (32,), torch.float32)
        try:
            queue.launch(exe, [view], [small], "aten.zero_.default(float32[32])", None, queue.task)  # LINE
        except NeuronMemoryError as e:
            print("ERROR", e)
        print("SMALL", small.cpu().sum().item())
    """
    line = next(i for i, text in enumerate(code.splitlines(), 1) if "# LINE" in text)
    _, _ = run_python(code, _cache(), env=dict(_GUARDED, TORCHNEURON_MEMORY=memory))
    out = _run(code, memory=memory)
    assert "ERROR neuron: aten.zero_.default(float32[32]) (issued at <string>:" in out
    assert f"<string>:{line - 1}" in out or f"<string>:{line}" in out
    assert "past its end" in out and "TORCHNEURON_CHECK_MEMORY" in out
    assert "SMALL 0.0" in out  # its own memory was written, as asked


def test_a_write_into_freed_memory_is_found_at_the_next_sync():
    code = """
        import ctypes, torch, torchneuron
        from torchneuron.runtime.memory_guards import NeuronMemoryError
        t = torch.ones(64, device="neuron")
        address = t.data_ptr()
        del t
        ctypes.memset(address + 8, 0, 4)  # a stale pointer's write
    """ + _SYNC_THEN_USE
    out = _run(code)
    assert "ERROR" in out and "after it was freed (first changed byte at offset 8)" in out
    assert "AFTER 12.0" in out  # reported once; the device stays usable


@pytest.mark.parametrize("memory", MODELS)
def test_an_executable_writing_into_freed_memory_is_found_at_the_next_sync(memory):
    # A launch through a stale address (a freed tensor's, still quarantined).
    code = """
        import torch, torchneuron
        from torchneuron.compiler import compile_mlir
        from torchneuron.dispatch.op_info import op_info
        from torchneuron.lowering import lower_call, signature_of
        from torchneuron.runtime import LoadedExecutable, device_queue
        from torchneuron.runtime.memory_guards import NeuronMemoryError

        op = torch.ops.aten.zero_.default
        info = op_info(op)
        mlir = lower_call(op, info, signature_of(op, info, (torch.ones(16, device="neuron"),), {})).mlir
        exe = LoadedExecutable(compile_mlir(mlir, "zero_")[0], "test", "aten.zero_.default(float32[16])")
        t = torch.ones(64, device="neuron")
        address = t.data_ptr()
        del t
        queue = device_queue(0)
        queue.launch(exe, [queue.task.import_at(address + 64, (16,), torch.float32)], [], "stale", None, queue.task)
    """ + _SYNC_THEN_USE + """
        print("STATS", torchneuron.transfer_stats()["memory_guard_bytes"] > 0)
    """
    out = _run(code, memory=memory)
    assert "ERROR" in out and "after it was freed (first changed byte at offset 64)" in out, out
    assert "AFTER 12.0" in out  # reported once; the device stays usable
    assert ("STATS True" in out) == (memory == "discrete"), out  # the guards were reached by transfers


@pytest.mark.parametrize("memory", MODELS)
def test_a_correct_workload_reports_nothing_and_matches_cpu(memory):
    code = """
        import torch, torchneuron
        torch.manual_seed(0)
        x = torch.randn(6, 6)
        xn = x.to("neuron")
        values, idx = xn.sort(0)
        s = xn.scatter_add(0, idx, torch.ones(6, 6, device="neuron"))
        g = xn[..., -1].sum()
        torch.testing.assert_close(values.cpu(), x.sort(0).values)
        torch.testing.assert_close(s.cpu(), x.scatter_add(0, x.sort(0).indices, torch.ones(6, 6)))
        assert torch.equal(xn.cpu(), x)
        w = torch.randn(6, 3, requires_grad=True)
        wn = w.detach().to("neuron").requires_grad_()
        (x @ w).tanh().sum().backward()
        (xn @ wn).tanh().sum().backward()
        torch.testing.assert_close(wn.grad.cpu(), w.grad)
        print("OK", g.item())
    """
    out = _run(code, memory=memory)
    assert "OK" in out


@pytest.mark.parametrize("memory", MODELS)
def test_falcon_trains_under_guards_as_on_cpu(memory):
    """The issue's Falcon model aborted with heap corruption in backward
    (an _index_put_impl_ with index -1 wrote before its tensor). Under the
    guards it now runs forward and backward and matches CPU."""
    code = """
        import torch, torchneuron
        from transformers import AutoConfig, AutoModel
        cfg = AutoConfig.for_model("falcon", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, vocab_size=128, max_position_embeddings=64,
                                   num_kv_heads=2, new_decoder_architecture=True)
        torch.manual_seed(0)
        cpu = AutoModel.from_config(cfg)
        dev = AutoModel.from_config(cfg)
        dev.load_state_dict(cpu.state_dict())
        dev = dev.to("neuron")
        ids = torch.randint(0, 128, (2, 12))
        cpu(ids).last_hidden_state.float().square().mean().backward()
        loss = dev(ids.to("neuron")).last_hidden_state.float().square().mean()
        loss.backward()
        for (name, p), pd in zip(cpu.named_parameters(), dev.parameters()):
            torch.testing.assert_close(pd.grad.cpu(), p.grad, rtol=1e-3, atol=1e-5, msg=lambda m: name + m)
        print("OK", loss.item())
    """
    out = _run(code, timeout=900, memory=memory)
    assert "OK" in out


def _run(code, timeout=300, memory="unified"):
    import subprocess
    import sys
    import textwrap

    env = dict(os.environ, TORCHNEURON_DEVICE_COUNT="1", TORCHNEURON_MEMORY=memory, **_GUARDED)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    return proc.stdout
