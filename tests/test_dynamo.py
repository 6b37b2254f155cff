"""torch.compile(backend="neuron"): whole forward and backward graphs,
compared with PyTorch CPU eager (results, gradients, and every argument
after the call)."""

import copy
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

import torchneuron
from torchneuron.dynamo import GraphCompileError
from torchneuron.models import GPT, GPTConfig


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    torch.compiler.set_default_backend(None)


def _dynamo_stats():
    return torchneuron.compile_stats()["dynamo"]


def _pair(module):
    torch.manual_seed(0)
    cpu = module()
    neuron = copy.deepcopy(cpu).to("neuron")
    return cpu, neuron


def _close(a, b, tol=1e-5):
    torch.testing.assert_close(a.detach().cpu(), b.detach(), rtol=tol, atol=tol)


def test_backend_is_listed_without_importing_torchneuron():
    code = (
        "import sys, torch, torch._dynamo\n"
        "names = torch._dynamo.list_backends()\n"
        "print('neuron' in names, 'torchneuron' in sys.modules)\n"
    )
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split()[-2:] == ["True", "False"]


def test_mlp_forward_and_backward_match_cpu():
    def mlp():
        return torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.GELU(), torch.nn.Linear(24, 5))

    cpu, neuron = _pair(mlp)
    before = _dynamo_stats().get("graphs_compiled", 0)
    compiled = torch.compile(neuron, backend="neuron")
    x = torch.randn(7, 12)
    xn = x.to("neuron")
    out = compiled(xn)
    out.square().sum().backward()
    expected = cpu(x)
    expected.square().sum().backward()
    _close(out, expected)
    _close(xn, x)  # the input is unchanged
    for p, q in zip(neuron.parameters(), cpu.parameters()):
        _close(p.grad, q.grad, 1e-4)
        _close(p, q)
    assert _dynamo_stats()["graphs_compiled"] - before == 2  # forward and backward


@pytest.mark.parametrize("mode", ["op", "adaptive"])
def test_graph_runs_beside_the_program_in_adaptive_mode(mode):
    """A compiled graph of many small tensors runs on the device's workers in
    adaptive eager mode (the program records the optimizer meanwhile), inline
    in op mode (where the next eager op would wait for it); same results."""
    from torchneuron.runtime import device_queue

    def mlp():
        return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(24)])

    cpu, neuron = _pair(mlp)
    compiled = torch.compile(neuron, backend="neuron")
    x = torch.randn(16, 64)
    with torchneuron.eager_mode(mode):
        compiled(x.to("neuron"))
        torch.neuron.synchronize()
        lanes = device_queue(0)
        task, inline = lanes.task.launches, lanes.inline.launches
        out = compiled(x.to("neuron"))
        torch.neuron.synchronize()
        ran = {"task": lanes.task.launches - task, "inline": lanes.inline.launches - inline}
    _close(out, cpu(x), 1e-4)
    assert ran == ({"task": 1, "inline": 0} if mode == "adaptive" else {"task": 0, "inline": 1})


def test_gpt_trains_20_steps_like_cpu():
    cfg = GPTConfig(dropout=0.0)
    cpu, neuron = _pair(lambda: GPT(cfg))
    opt_cpu = torch.optim.AdamW(cpu.parameters(), lr=1e-3)
    opt_neuron = torch.optim.AdamW(neuron.parameters(), lr=1e-3)
    compiled = torch.compile(neuron, backend="neuron")
    g = torch.Generator().manual_seed(1)
    before = _dynamo_stats().get("graphs_compiled", 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no graph may fall back
        for _ in range(20):
            x = torch.randint(0, cfg.vocab_size, (4, cfg.block_size), generator=g)
            y = torch.randint(0, cfg.vocab_size, (4, cfg.block_size), generator=g)
            _, loss = cpu(x, y)
            opt_cpu.zero_grad()
            loss.backward()
            opt_cpu.step()
            _, loss_n = compiled(x.to("neuron"), y.to("neuron"))
            opt_neuron.zero_grad()
            loss_n.backward()
            opt_neuron.step()
            assert abs(loss_n.item() - loss.item()) < 1e-4
    assert "graphs_fallback" not in _dynamo_stats()
    assert _dynamo_stats()["graphs_compiled"] - before == 2  # the forward and the backward


def test_batchnorm_in_train_mode_updates_running_statistics():
    def cnn():
        return torch.nn.Sequential(
            torch.nn.Conv2d(3, 6, 3, padding=1), torch.nn.BatchNorm2d(6), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(6, 3),
        )

    cpu, neuron = _pair(cnn)
    compiled = torch.compile(neuron, backend="neuron")
    for _ in range(2):
        x = torch.randn(4, 3, 6, 6)
        out = compiled(x.to("neuron"))
        out.sum().backward()
        expected = cpu(x)
        expected.sum().backward()
        _close(out, expected)
    bn, bn_cpu = neuron[1], cpu[1]
    _close(bn.running_mean, bn_cpu.running_mean)
    _close(bn.running_var, bn_cpu.running_var)
    assert bn.num_batches_tracked.item() == bn_cpu.num_batches_tracked.item() == 2
    _close(neuron[0].weight.grad, cpu[0].weight.grad, 1e-4)


def test_graph_break_runs_both_pieces():
    def fn(x):
        y = torch.sin(x) * 2
        torch._dynamo.graph_break()
        return torch.cos(y) + x

    x = torch.randn(5, 9)
    before = _dynamo_stats().get("graphs_compiled", 0)
    out = torch.compile(fn, backend="neuron")(x.to("neuron"))
    _close(out, fn(x))
    assert _dynamo_stats()["graphs_compiled"] - before == 2  # one graph each side of the break


def test_dynamic_sequence_length_compiles_once():
    def seq():
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))

    cpu, neuron = _pair(seq)
    compiled = torch.compile(neuron, backend="neuron")
    before = dict(_dynamo_stats())
    for length in (5, 9, 17):
        x = torch.randn(2, length, 16)
        xn = x.to("neuron")
        torch._dynamo.mark_dynamic(xn, 1)
        out = compiled(xn)
        out.sum().backward()
        expected = cpu(x)
        expected.sum().backward()
        _close(out, expected)
        _close(neuron[0].weight.grad, cpu[0].weight.grad, 1e-4)
    after = _dynamo_stats()
    assert after["graphs_compiled"] - before.get("graphs_compiled", 0) == 2  # one forward, one backward
    assert after["graphs_dynamic"] - before.get("graphs_dynamic", 0) == 2


def test_compiled_optimizer_step():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(10, 6))
    pn = torch.nn.Parameter(p.detach().clone().to("neuron"))
    opt = torch.optim.Adam([p], lr=0.05)
    opt_n = torch.optim.Adam([pn], lr=0.05)

    @torch.compile(backend="neuron")
    def step():
        opt_n.step()

    for _ in range(3):
        grad = torch.randn(10, 6)
        p.grad = grad.clone()
        pn.grad = grad.to("neuron")
        opt.step()
        step()
    _close(pn, p)
    _close(opt_n.state[pn]["exp_avg_sq"], opt.state[p]["exp_avg_sq"])


def test_compiled_optimizer_step_over_many_parameters_compiles_in_pieces():
    # IREE gathers the step counters' one-element arithmetic into one dispatch
    # with about 3 buffers per parameter; past 32 the runtime refuses it. The
    # graph is compiled as independent pieces instead of running eagerly.
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*(10, 6) if i % 2 else (7,))) for i in range(24)]
    neuron = [torch.nn.Parameter(p.detach().clone().to("neuron")) for p in params]
    opt = torch.optim.AdamW(params, lr=0.05)
    opt_n = torch.optim.AdamW(neuron, lr=0.05)

    @torch.compile(backend="neuron")
    def step():
        opt_n.step()

    before = _dynamo_stats()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="neuron: a torch.compile")
        for _ in range(3):
            for p, pn in zip(params, neuron):
                grad = torch.randn(p.shape)
                p.grad, pn.grad = grad.clone(), grad.to("neuron")
            opt.step()
            step()
    after = _dynamo_stats()
    assert after.get("graphs_split", 0) > before.get("graphs_split", 0)
    assert after.get("graphs_fallback", 0) == before.get("graphs_fallback", 0)
    assert after["graphs_compiled"] - before.get("graphs_compiled", 0) >= 2
    for p, pn in zip(params, neuron):
        _close(pn, p)
        _close(opt_n.state[pn]["exp_avg_sq"], opt.state[p]["exp_avg_sq"])
        _close(opt_n.state[pn]["step"], opt.state[p]["step"])


def test_one_computation_over_many_counters_compiles_in_consecutive_pieces():
    # One chain through 40 one-element inputs: no independent parts, so the
    # pieces are consecutive runs of ops, each feeding the next.
    xs = [torch.rand(1) + 0.5 for _ in range(40)]
    y = torch.randn(5)

    def chain(xs, y):
        acc = y
        for x in xs:
            acc = acc * (x * 0.5 + 0.75)
        return acc

    before = _dynamo_stats()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="neuron: a torch.compile")
        out = torch.compile(chain, backend="neuron")([x.to("neuron") for x in xs], y.to("neuron"))
    after = _dynamo_stats()
    assert after.get("graphs_split", 0) > before.get("graphs_split", 0)
    assert after.get("graphs_fallback", 0) == before.get("graphs_fallback", 0)
    _close(out, chain(xs, y))


class _Block(torch.nn.Module):
    # A module of the user's own: Dynamo skips a bare nn.Sequential of torch's
    # modules under Module.compile() (torch's files are on its skip list).
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(6, 6)

    def forward(self, x):
        return torch.relu(self.linear(x)) * 2


def _causal(score, b, h, q, kv):
    return torch.where(q >= kv, score, -float("inf"))


def _sliding_window(b, h, q, kv):
    return (q >= kv) & (q - kv <= 40)


class _FlexBlock(torch.nn.Module):
    """A projection around attention: flex_attention with a causal score_mod
    and a sliding-window block mask, or (block_mask None) the same masks as
    one explicit scaled_dot_product_attention mask, the CPU reference (torch
    2.13's flex_attention has no backward on CPU)."""

    def __init__(self, dim):
        super().__init__()
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, q, k, v, block_mask=None):
        from torch.nn.attention.flex_attention import flex_attention

        if block_mask is None:
            i = torch.arange(q.shape[-2], device=q.device)
            mask = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] <= 40)
            out = torch.nn.functional.scaled_dot_product_attention(self.proj(q), k, v, attn_mask=mask)
        else:
            out = flex_attention(self.proj(q), k, v, score_mod=_causal, block_mask=block_mask)
        return self.proj(out)


def test_flex_attention_with_score_mod_and_block_mask():
    from torch._dynamo.utils import counters
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    counters.clear()
    # 256 positions in blocks of 128: one block pair is skipped whole, the others are masked inside.
    batch, heads, length, dim = 1, 2, 256, 16
    torch.manual_seed(0)
    q, k, v = (torch.randn(batch, heads, length, dim) for _ in range(3))
    block_mask = create_block_mask(_sliding_window, batch, heads, length, length, device="neuron")
    assert block_mask.sparsity() > 0
    cpu_mask = create_block_mask(_sliding_window, batch, heads, length, length, device="cpu")
    before = dict(_dynamo_stats())

    # Inference, against flex_attention on CPU.
    compiled = torch.compile(flex_attention, backend="neuron")
    out = compiled(q.to("neuron"), k.to("neuron"), v.to("neuron"), score_mod=_causal, block_mask=block_mask)
    _close(out, flex_attention(q, k, v, score_mod=_causal, block_mask=cpu_mask), tol=1e-4)

    # Training, against the same masks as an explicit SDPA mask on CPU.
    cpu, neuron = _pair(lambda: _FlexBlock(dim))
    q_cpu, q_neuron = q.clone().requires_grad_(), q.to("neuron").requires_grad_()
    expected = cpu(q_cpu, k, v)
    got = torch.compile(neuron, backend="neuron")(q_neuron, k.to("neuron"), v.to("neuron"), block_mask)
    _close(got, expected, tol=1e-4)
    expected.square().sum().backward()
    got.square().sum().backward()
    _close(q_neuron.grad, q_cpu.grad, tol=1e-4)
    _close(neuron.proj.weight.grad, cpu.proj.weight.grad, tol=1e-4)

    after = _dynamo_stats()
    assert after.get("graphs_compiled", 0) - before.get("graphs_compiled", 0) == 3  # inference, forward, backward
    assert after.get("graphs_fallback", 0) == before.get("graphs_fallback", 0)
    assert not counters["graph_break"]


@pytest.mark.parametrize("masking", ["causal", "explicit"])
def test_scaled_dot_product_attention(masking):
    def attend(q, k, v, mask):
        if mask is None:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 24, 8, requires_grad=True) for _ in range(3))
    mask = torch.randn(24, 24) > -0.5 if masking == "explicit" else None
    neuron = [t.detach().to("neuron").requires_grad_() for t in (q, k, v)]
    before = dict(_dynamo_stats())
    got = torch.compile(attend, backend="neuron")(*neuron, None if mask is None else mask.to("neuron"))
    expected = attend(q, k, v, mask)
    _close(got, expected, tol=1e-4)
    got.sum().backward()
    expected.sum().backward()
    for a, b in zip(neuron, (q, k, v)):
        _close(a.grad, b.grad, tol=1e-4)
    after = _dynamo_stats()
    assert after.get("graphs_compiled", 0) - before.get("graphs_compiled", 0) == 2
    assert after.get("graphs_fallback", 0) == before.get("graphs_fallback", 0)


def test_default_backend_then_module_compile():
    cpu, neuron = _pair(_Block)
    torch.compiler.set_default_backend("neuron")
    neuron.compile()
    before = _dynamo_stats().get("graphs_compiled", 0)
    x = torch.randn(3, 6)
    with torch.no_grad():
        _close(neuron(x.to("neuron")), cpu(x))
    assert _dynamo_stats()["graphs_compiled"] - before == 1  # an inference graph


def test_graph_that_fails_to_compile_falls_back_with_one_warning():
    def fn(x):
        return torch.tanh(x) * 3 + 1

    x = torch.randn(4, 4)
    compiled = torch.compile(fn, backend="neuron", options={"compiler_flags": ["--iree-no-such-flag"]})
    with pytest.warns(RuntimeWarning) as caught:
        out = compiled(x.to("neuron"))
    ours = [w for w in caught if "torch.compile" in str(w.message)]
    assert len(ours) == 1
    assert "runs in neuron eager mode" in str(ours[0].message)
    _close(out, fn(x))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning: the fallback is compiled once
        _close(compiled(x.to("neuron")), fn(x))


def test_strict_setting_raises_instead_of_falling_back():
    def fn(x):
        return torch.tanh(x) * 3 + 2

    compiled = torch.compile(fn, backend="neuron",
                             options={"compiler_flags": ["--iree-no-such-flag"], "strict": True})
    with pytest.raises(Exception) as raised:
        compiled(torch.randn(4, 4).to("neuron"))
    chain, e = [], raised.value
    while e is not None:
        chain.append(e)
        e = e.__cause__ or e.__context__
    assert any(isinstance(e, GraphCompileError) for e in chain)


def test_in_place_updates_of_many_counters_compile_in_pieces():
    # 40 scalar updates: IREE would form one scalar dispatch with 80 bindings,
    # which the runtime refuses (limit 32); the graph's one-element inputs
    # predict it, so it is compiled as pieces from the start.
    def bump(scalars):
        for s in scalars:
            s.mul_(0.5).add_(1.0)

    torch.manual_seed(0)
    cpu = [torch.randn(()) for _ in range(40)]
    neuron = [t.to("neuron") for t in cpu]
    before = _dynamo_stats()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="neuron: a torch.compile")
        torch.compile(bump, backend="neuron")(neuron)
    after = _dynamo_stats()
    assert after.get("graphs_split", 0) - before.get("graphs_split", 0) == 1
    assert after.get("graphs_fallback", 0) == before.get("graphs_fallback", 0)
    bump(cpu)
    for a, b in zip(neuron, cpu):
        _close(a, b)


def test_executable_the_runtime_refuses_is_compiled_again_in_pieces():
    # One-element values taken from one larger input: nothing predicts the
    # scalar dispatch (41 bindings), so the whole graph compiles, the runtime
    # refuses to load it, and it is split by what the refusal says.
    def take(big):
        return [big[i] * 0.5 + 1.0 for i in range(40)]

    big = torch.randn(40)
    before = _dynamo_stats()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="neuron: a torch.compile")
        out = torch.compile(take, backend="neuron")(big.to("neuron"))
    after = _dynamo_stats()
    assert after.get("graphs_split", 0) - before.get("graphs_split", 0) == 1
    assert after["graphs_compiled"] - before.get("graphs_compiled", 0) >= 2
    for a, b in zip(out, take(big)):
        _close(a, b)


def test_graph_that_data_tiling_fails_to_compile_compiles_without_it(monkeypatch):
    # A large batched matmul feeding a broadcasting where: IREE 3.13's data
    # tiling fails on it ("load_from_buffer op buffer and tensor shapes must
    # be compatible"); the compile is retried without data tiling.
    from torchneuron.compiler import data_tiling
    from torchneuron.cache import executables

    tried = []
    compile_one = executables._executable_for

    def spy(mlir, what, target, *rest):
        if "torch.compile" in what:
            tried.append(data_tiling.ON in target[1])
        return compile_one(mlir, what, target, *rest)

    monkeypatch.setattr(executables, "_executable_for", spy)

    def scores(q, k, mask):
        s = torch.bmm(q, k).view(2, 16, 256, 256) * 0.25
        return torch.where(mask, s, torch.tensor(float("-inf"), device=s.device))

    torch.manual_seed(0)
    q, k = torch.randn(32, 256, 128), torch.randn(32, 128, 256)
    mask = torch.ones(1, 1, 256, 256, dtype=torch.bool).tril()
    before = dict(_dynamo_stats())
    out = torch.compile(scores, backend="neuron")(q.to("neuron"), k.to("neuron"), mask.to("neuron"))
    _close(out, scores(q, k, mask), tol=1e-4)
    after = _dynamo_stats()
    assert after.get("graphs_compiled", 0) == before.get("graphs_compiled", 0) + 1
    assert after.get("graphs_fallback", 0) == before.get("graphs_fallback", 0)
    assert tried == [True, False]  # tiled first (a matmul this large gains from it), then without


def test_recompile_storm_is_reported():
    def fn(x):
        return x * 2 + 1

    compiled = torch.compile(fn, backend="neuron", dynamic=False)
    before = _dynamo_stats().get("recompiles", 0)
    with torch._dynamo.config.patch(recompile_limit=3), pytest.warns(RuntimeWarning) as caught:
        for n in range(2, 8):  # a new static shape each call
            x = torch.randn(n)
            _close(compiled(x.to("neuron")), fn(x))
    ours = [str(w.message) for w in caught if "recompile limit" in str(w.message)]
    assert len(ours) == 1 and "3 times" in ours[0]
    assert _dynamo_stats().get("recompiles", 0) - before == 2  # compiles 2 and 3; later calls run eagerly


def test_unknown_option_is_refused():
    with pytest.raises(Exception, match="unknown options"):
        torch.compile(lambda x: x + 1, backend="neuron", options={"no_such_option": 1})(torch.ones(2).to("neuron"))


_RESTART = """
import json, torch, torchneuron
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).to("neuron")
out = torch.compile(model, backend="neuron")(torch.randn(3, 8).to("neuron"))
out.sum().backward()
stats = torchneuron.compile_stats()
print(json.dumps({"compiled": stats["sources"].get("compiled", 0), "graphs": stats["dynamo"]}))
"""


def test_restarted_process_compiles_nothing(tmp_path):
    env = dict(os.environ, TORCHNEURON_CACHE_DIR=str(tmp_path / "cache"))
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", _RESTART], env=env, capture_output=True, text=True, check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert runs[0]["compiled"] >= 2 and runs[0]["graphs"]["graphs_compiled"] == 2
    assert runs[1]["compiled"] == 0 and runs[1]["graphs"]["graphs_compiled"] == 2
