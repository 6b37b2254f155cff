"""Ops issued while the program has PyTorch modes active compute what they
compute without them, and cache the same executables.

An op reaches the lowering inside the dispatcher; under a TorchDispatchMode
(a user's, or AOTAutograd's runtime, which runs compiled graphs under one)
the thread excludes functionalization, and an export traced there once
recorded no writes at all: an executable that left its results
uninitialized, cached on disk for every later process. Each test uses
shapes no other test uses, so its ops are lowered under the mode here.
"""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import torchneuron  # noqa: F401


class PassThrough(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def _embedding_sum_add(weight, index, other):
    e = torch.ops.aten.embedding.default(weight, index)
    s = torch.ops.aten.sum.default(other)
    return torch.ops.aten.add.Tensor(e, s)


def test_ops_under_a_dispatch_mode_match_cpu():
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(57, 11, generator=g)
    index = torch.randint(0, 57, (3, 13), generator=g)
    other = torch.randint(0, 50, (5, 7), generator=g)
    args = [t.to("neuron") for t in (weight, index, other)]
    before = [t.clone() for t in (weight, index, other)]
    mode = PassThrough()
    with mode:
        got = _embedding_sum_add(*args)
    torch.neuron.synchronize()
    torch.testing.assert_close(got.cpu(), _embedding_sum_add(weight, index, other))
    for arg, original in zip(args, before):
        torch.testing.assert_close(arg.cpu(), original)  # nothing else written
    assert "aten.embedding.default" in mode.seen  # the mode saw the ops


def test_ops_under_a_device_function_mode_match_cpu():
    x = torch.randn(9, 17)
    with torch.device("neuron"):
        y = torch.ones(9, 17)  # the mode makes this a neuron tensor
        got = torch.ops.aten.addcmul.default(x.to("neuron"), y, x.to("neuron"), value=0.5)
    assert y.device.type == "neuron"
    torch.testing.assert_close(got.cpu(), torch.addcmul(x, torch.ones(9, 17), x, value=0.5))


def test_eager_ops_inside_aot_autograd_runtime_match_cpu():
    """backend="aot_eager" runs the traced graph's ATen ops eagerly on neuron
    inside AOTAutograd's runtime (under its dispatch mode)."""
    torch.manual_seed(0)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(61, 19)
            self.proj = torch.nn.Linear(19, 61)

        def forward(self, tokens, targets):
            logits = self.proj(self.embed(tokens))
            return torch.nn.functional.cross_entropy(logits.view(-1, 61), targets.view(-1))

    cpu_model = Model()
    neuron_model = Model().to("neuron")
    neuron_model.load_state_dict(cpu_model.state_dict())
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 61, (3, 11), generator=g)
    targets = torch.randint(0, 61, (3, 11), generator=g)
    compiled = torch.compile(neuron_model, backend="aot_eager")
    loss = compiled(tokens.to("neuron"), targets.to("neuron"))
    loss.backward()
    expected = cpu_model(tokens, targets)
    expected.backward()
    torch.testing.assert_close(loss.cpu(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(neuron_model.proj.weight.grad.cpu(), cpu_model.proj.weight.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(neuron_model.embed.weight.grad.cpu(), cpu_model.embed.weight.grad, rtol=1e-4, atol=1e-5)
