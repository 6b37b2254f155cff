"""Checks that an op touched only the memory it owns, shared by the OpInfo
conformance runner and the generated unit tests.

An op that returns the right result but also changes an argument it should
only read, or returns memory that aliases an argument when PyTorch returns
new memory, corrupts the user's data silently; comparing results alone does
not see it. Two checks, each against PyTorch CPU's behaviour for the same call:

- every argument CPU leaves unchanged is bit-for-bit unchanged on neuron;
- a result shares memory with an argument on neuron exactly when it does on CPU.
"""

from __future__ import annotations

import torch


def tensor_leaves(value) -> list:
    """The dense tensors in an argument structure, in order (lists, tuples,
    dicts). Sparse tensors have no plain memory to compare: left out."""
    out = []
    if isinstance(value, torch.Tensor):
        if value.layout == torch.strided:
            out.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            out.extend(tensor_leaves(v))
    elif isinstance(value, dict):
        for v in value.values():
            out.extend(tensor_leaves(v))
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as raw bytes, on the host (NaNs and -0.0 compare by bits)."""
    t = t.detach()
    if t.is_conj():
        t = t.conj()  # the memory behind a conjugate view, without the bit
    if t.is_neg():
        t = torch._neg_view(t)
    if t.device.type != "cpu":
        t = t.cpu()
    # A one-element tensor counts as contiguous whatever its stride, which a
    # byte view rejects: a copy in the contiguous format has stride 1.
    return t.clone(memory_format=torch.contiguous_format).reshape(-1).view(torch.uint8)


def snapshot(tensors: list) -> list:
    return [_bits(t) for t in tensors]


def changed(tensors: list, before: list) -> list:
    """Indices of the tensors whose bytes differ from the snapshot."""
    return [i for i, (t, b) in enumerate(zip(tensors, before)) if not torch.equal(_bits(t), b)]


def check_unchanged(dev_tensors, dev_before, cpu_tensors, cpu_before, names=None) -> None:
    """Every argument CPU did not write is bit-for-bit unchanged on neuron."""
    cpu_wrote = set(changed(cpu_tensors, cpu_before))
    for i in changed(dev_tensors, dev_before):
        if i not in cpu_wrote:
            name = names[i] if names and i < len(names) else f"tensor argument {i}"
            t = dev_tensors[i]
            raise AssertionError(
                f"the op wrote {name} ({str(t.dtype).replace('torch.', '')}{list(t.shape)}), "
                "which it only reads on CPU"
            )


def _storage(t: torch.Tensor):
    if t.numel() == 0:
        return None
    return t.untyped_storage().data_ptr()


def aliasing(outputs: list, inputs: list) -> list:
    """For each output, the set of input indices whose memory it shares."""
    storages = [_storage(t) for t in inputs]
    return [{j for j, s in enumerate(storages) if s is not None and s == _storage(o)} for o in outputs]


def check_aliasing(dev_outputs, dev_inputs, cpu_outputs, cpu_inputs) -> None:
    """A neuron result aliases an argument exactly when the CPU result does."""
    dev = aliasing(dev_outputs, dev_inputs)
    cpu = aliasing(cpu_outputs, cpu_inputs)
    for k, (d, c) in enumerate(zip(dev, cpu)):
        if d - c:
            raise AssertionError(f"result {k} shares memory with argument {sorted(d - c)}, which it does not on CPU")
        if c - d:
            raise AssertionError(f"result {k} is new memory where CPU returns a view of argument {sorted(c - d)}")
