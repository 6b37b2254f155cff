"""The kernel library (torchneuron.kernels): every kernel on neuron against
its pure-PyTorch reference on CPU (results, gradients, arguments after the
call), the simulator on CPU tensors for one, and torch.library.opcheck for
every operator."""

import pytest
import torch

import torchneuron  # noqa: F401
from torchneuron import kernels as K


def _close(got, expected, tol=1e-4):
    got = got if isinstance(got, tuple) else (got,)
    expected = expected if isinstance(expected, tuple) else (expected,)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g.detach().cpu().float(), e.detach().float(), rtol=tol, atol=tol)


def _cases():
    torch.manual_seed(0)
    x, r, w = torch.randn(2, 24, 80), torch.randn(2, 24, 80), torch.randn(80)
    cos, sin = torch.randn(24, 80), torch.randn(24, 80)
    logits, target = torch.randn(48, 3000), torch.randint(0, 3000, (48,))
    target[5] = -100  # ignored
    q, k, v = (torch.randn(2, 3, 256, 32) for _ in range(3))
    tokens, probs = torch.randn(96, 48), torch.softmax(torch.randn(96, 6), -1)
    w1, w2 = torch.randn(6, 48, 160) * 0.1, torch.randn(6, 160, 48) * 0.1
    # Paged attention over a cache of 24 blocks of 8 slots, 2 KV heads for 4 query heads:
    # a prefill of 11 tokens after 9 cached, a decode step at 30, a one-token context, a padded request.
    cache = torch.randn(24 * 8, 2, 2 * 32)
    table = torch.randint(1, 24, (4, 4), dtype=torch.int32)
    context_lens, query_lens = torch.tensor([20, 30, 1, 0], dtype=torch.int32), torch.tensor([11, 1, 1, 0], dtype=torch.int32)
    paged = (torch.randn(4, 4, 16, 32), cache, table, context_lens, query_lens)
    # Long prefills: 4 query heads a KV head whose 64 queries do not fit one tile (two programs
    # each), a context of 32 blocks of 8 (two chunks of 128 slots), a sliding window.
    long_prefill = (torch.randn(2, 8, 64, 32), torch.randn(80 * 8, 2, 64),
                    torch.randint(1, 80, (2, 32), dtype=torch.int32), torch.tensor([250, 70], dtype=torch.int32),
                    torch.tensor([64, 33], dtype=torch.int32))
    return {
        "rms_norm": (K.rms_norm, K.rms_norm_reference, (x, w), {}),
        "add_rms_norm": (K.add_rms_norm, K.add_rms_norm_reference, (x, r, w), {}),
        "softmax": (K.softmax, K.softmax_reference, (x,), {}),
        "log_softmax": (K.log_softmax, K.log_softmax_reference, (x,), {}),
        "swiglu": (K.swiglu, K.swiglu_reference, (x, r), {}),
        "rotary": (K.rotary, K.rotary_reference, (x, cos, sin), {}),
        "cross_entropy": (K.cross_entropy, K.cross_entropy_reference, (logits, target), {}),
        "flash_attention": (K.flash_attention, K.flash_attention_reference, (q, k, v), {"causal": False}),
        "flash_attention_causal": (K.flash_attention, K.flash_attention_reference, (q, k, v), {"causal": True}),
        "flash_attention_bfloat16": (K.flash_attention, K.flash_attention_reference,
                                     tuple(t.bfloat16() for t in (q, k, v)), {"causal": True}),
        "moe": (K.moe, K.moe_reference, (tokens, probs, w1, w2), {"top_k": 2}),
        "moe_gated": (K.moe, K.moe_reference, (tokens, probs, torch.randn(6, 48, 320) * 0.1, w2), {"top_k": 2}),
        "moe_routed": (K.moe_routed, K.moe_routed_reference, (tokens, *probs.topk(3, -1), w1, w2), {}),
        "paged_attention": (K.paged_attention, K.paged_attention_reference, paged, {"block_size": 8}),
        "paged_attention_window": (K.paged_attention, K.paged_attention_reference, paged,
                                   {"block_size": 8, "sliding_window": 5, "scale": 0.3}),
        "paged_attention_long": (K.paged_attention, K.paged_attention_reference, long_prefill,
                                 {"block_size": 8, "sliding_window": 100}),
    }


@pytest.mark.parametrize("name", list(_cases()))
def test_kernel_matches_its_reference_on_neuron(name):
    kernel, reference, args, kwargs = _cases()[name]
    originals = [a.clone() for a in args]
    neuron = [a.to("neuron") for a in args]
    got = kernel(*neuron, **kwargs)
    _close(got, reference(*args, **kwargs), 2e-2 if "bfloat16" in name else 1e-4)
    for a, o in zip(neuron, originals):  # inputs unchanged
        assert torch.equal(a.cpu(), o)


@pytest.mark.parametrize("name", ["flash_attention_causal", "paged_attention_window"])
def test_the_simulator_runs_the_library_on_cpu_tensors(name):
    kernel, reference, args, kwargs = _cases()[name]
    _close(kernel(*args, **kwargs), reference(*args, **kwargs))


@pytest.mark.parametrize("name", ["rms_norm", "add_rms_norm", "rotary", "cross_entropy", "flash_attention_causal", "moe"])
def test_gradients_through_the_library(name):
    kernel, reference, args, kwargs = _cases()[name]
    floats = [a.is_floating_point() for a in args]
    cpu = [a.clone().requires_grad_(f) for a, f in zip(args, floats)]
    neuron = [a.to("neuron").requires_grad_(f) for a, f in zip(args, floats)]

    def loss(out):
        outs = out if isinstance(out, tuple) else (out,)
        return sum((o.float() * (i + 1)).square().sum() for i, o in enumerate(outs))

    loss(kernel(*neuron, **kwargs)).backward()
    loss(reference(*cpu, **kwargs)).backward()
    for n, c in zip(neuron, cpu):
        if c.requires_grad:
            _close(n.grad, c.grad, 1e-3)


def _opcheck_calls() -> dict:
    cases = _cases()
    x, r, w = (a.to("neuron") for a in cases["add_rms_norm"][2])
    cos, sin = (a.to("neuron") for a in cases["rotary"][2][1:])
    logits, target = (a.to("neuron") for a in cases["cross_entropy"][2])
    q, k, v = (a.to("neuron") for a in cases["flash_attention"][2])
    rows = x.reshape(-1, 80)
    q3, k3, v3 = (t.reshape(-1, 256, 32) for t in (q, k, v))
    lse = torch.randn(6, 256, 1, device="neuron")
    ops = torch.ops.neuron_kernels
    return {
        "rms_norm": (ops.rms_norm, (rows, w[None], 1e-6)),
        "add_rms_norm": (ops.add_rms_norm, (rows, r.reshape(-1, 80), w[None], 1e-6)),
        "softmax": (ops.softmax, (rows, True)),
        "swiglu": (ops.swiglu, (rows, r.reshape(-1, 80))),
        "rotary": (ops.rotary, (rows, cos.repeat(2, 1), sin.repeat(2, 1))),
        "cross_entropy": (ops.cross_entropy, (logits, target.clamp(min=0).to(torch.int32)[:, None].contiguous())),
        "flash_attention": (ops.flash_attention, (q3, k3, v3, True, 0.2)),
        "flash_attention_backward_kv": (ops.flash_attention_backward_kv, (q3, k3, v3, q3, k3, lse, True, 0.2)),
        "flash_attention_backward_q": (ops.flash_attention_backward_q, (q3, k3, v3, q3, k3, lse, False, 0.2)),
        "moe_experts": (ops.moe_experts, (rows, torch.arange(64, dtype=torch.int32, device="neuron") % 48,
                                          torch.rand(64, device="neuron"), torch.randn(2, 80, 16, device="neuron"),
                                          torch.randn(2, 16, 80, device="neuron"), 32)),
        "paged_attention": (ops.paged_attention,
                            tuple(a.to("neuron") for a in cases["paged_attention"][2]) + (0.2, 8, 0)),
    }


# CI checks the operators whose schemas carry the most (optional and integer
# arguments, int32 tensors, several results); the rest are `thorough` (their
# kernels' compiles took most of the test's 4 minutes).
_OPCHECK_IN_CI = ("flash_attention", "moe_experts", "paged_attention", "cross_entropy")


@pytest.mark.parametrize("name", [name if name in _OPCHECK_IN_CI else pytest.param(name, marks=pytest.mark.thorough)
                                  for name in ("rms_norm", "add_rms_norm", "softmax", "swiglu", "rotary",
                                               "cross_entropy", "flash_attention", "flash_attention_backward_kv",
                                               "flash_attention_backward_q", "moe_experts", "paged_attention")])
def test_every_library_operator_passes_opcheck(name):
    op, args = _opcheck_calls()[name]
    torch.library.opcheck(op, args)


def test_shapes_a_kernel_does_not_take():
    odd = torch.randn(131, 5)  # a prime number of rows over 128: blocks of one row
    _close(K.softmax(odd.to("neuron")), K.softmax_reference(odd))
    q = torch.randn(1, 2, 16, 200)  # head dim over 128
    _close(K.flash_attention(q.to("neuron"), q.to("neuron"), q.to("neuron")), K.flash_attention_reference(q, q, q))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "torch.compile"])
def test_a_transformers_llama_on_the_library_matches_the_stock_model(compiled):
    import copy
    import warnings

    from transformers import LlamaConfig, LlamaForCausalLM

    from torchneuron.kernels import attention, hf, norms

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    stock = LlamaForCausalLM(cfg)
    ours = hf.use_kernels(copy.deepcopy(stock).to("neuron"))
    ids = torch.randint(0, 128, (2, 32))
    expected = stock(input_ids=ids, labels=ids)
    expected.loss.backward()
    for kernel in (attention._forward, attention._backward_q, attention._backward_kv):
        kernel._compiled.clear()
    norms._rms_norm._compiled.clear()
    torch._dynamo.reset()
    model = torch.compile(ours, backend="neuron") if compiled else ours
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="neuron: a torch.compile")
        got = model(input_ids=ids.to("neuron"), labels=ids.to("neuron"))
        got.loss.backward()
    torch._dynamo.reset()
    assert attention._forward._compiled and norms._rms_norm._compiled  # the kernels ran
    assert attention._backward_q._compiled and attention._backward_kv._compiled  # and attention's backward
    _close(got.logits, expected.logits)
    _close(got.loss, expected.loss)
    for a, b in zip(ours.parameters(), stock.parameters()):
        _close(a.grad, b.grad)
