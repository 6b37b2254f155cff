"""Every op that reads or writes through indices raises on an out-of-range
index, as CPU does, and takes negative indices where CPU does (issue 11).

A device reads and writes out of range silently; the compiled ops check their
indices on the device and the error is raised at the next sync point."""

import pytest
import torch

from torchneuron.runtime.errors import NeuronAsyncError

_X = torch.randn(5, 4)


def _cases(bad: bool):
    """(name, fn(x, idx)) where idx is a valid index tensor or, with bad, one out of range."""
    i = torch.tensor([[0, 9 if bad else 4, 1, 2]])  # dim 0 of x has 5 rows
    rows = torch.tensor([1, 7 if bad else 3])
    flat = torch.tensor([0, 25 if bad else -3])  # x has 20 elements
    target = torch.tensor([0, 6 if bad else 3, 1, 2, -100])  # 4 classes
    # CPU's take_along_dim does not check its indices: nothing to match there.
    along = [] if bad else [("take_along_dim", lambda x: torch.take_along_dim(x, i.to(x.device), 0))]
    return along + [
        ("gather", lambda x: x.gather(0, i.to(x.device))),
        ("index_select", lambda x: x.index_select(0, rows.to(x.device))),
        ("embedding", lambda x: torch.nn.functional.embedding(rows.to(x.device), x)),
        ("take", lambda x: x.take(flat.to(x.device))),
        ("indexing", lambda x: x[rows.to(x.device)]),
        ("scatter", lambda x: x.scatter(0, i.to(x.device), 1.0)),
        ("scatter_add", lambda x: x.scatter_add(0, i.to(x.device), torch.ones(1, 4, device=x.device))),
        ("scatter_reduce", lambda x: x.scatter_reduce(0, i.to(x.device), torch.ones(1, 4, device=x.device), "amax")),
        ("index_add", lambda x: x.index_add(0, rows.to(x.device), torch.ones(2, 4, device=x.device))),
        ("index_copy", lambda x: x.index_copy(0, rows.to(x.device), torch.ones(2, 4, device=x.device))),
        ("index_fill", lambda x: x.index_fill(0, rows.to(x.device), -1.0)),
        ("index_put", lambda x: x.index_put((rows.to(x.device),), torch.ones(4, device=x.device))),
        ("index_put accumulate", lambda x: x.index_put((rows.to(x.device),), torch.ones(4, device=x.device), True)),
        ("put", lambda x: x.put(flat.to(x.device), torch.ones(2, device=x.device))),
        ("cross_entropy", lambda x: torch.nn.functional.cross_entropy(x, target.to(x.device))),
        ("nll_loss", lambda x: torch.nn.functional.nll_loss(x.log_softmax(1), target.to(x.device))),
    ]


@pytest.mark.parametrize("case", range(len(_cases(False))), ids=[c[0] for c in _cases(False)])
def test_valid_and_negative_indices_match_cpu(case):
    _, fn = _cases(False)[case]
    x = _X.clone()
    xn = x.to("neuron")
    torch.testing.assert_close(fn(xn).cpu(), fn(x))
    assert torch.equal(xn.cpu(), _X)


@pytest.mark.parametrize("case", range(len(_cases(True))), ids=[c[0] for c in _cases(True)])
def test_out_of_range_index_raises_as_on_cpu(case):
    name, fn = _cases(True)[case]
    with pytest.raises((IndexError, RuntimeError)):
        fn(_X.clone())
    xn = _X.to("neuron")
    with pytest.raises((NeuronAsyncError, IndexError, RuntimeError), match="out of range|out of bounds|index"):
        fn(xn)
        torch.neuron.synchronize()
    # Nothing outside the tensors was touched: the device stays usable and correct.
    torch.testing.assert_close((xn * 2).cpu(), _X * 2)


def test_negative_index_in_backward_of_indexing():
    """x[..., -1, :] backward runs _index_put_impl_ with index -1 (Falcon's
    attention): torch-mlir's scatter did not wrap it and wrote before the tensor."""
    x = torch.randn(2, 12, 2, 4, 8, requires_grad=True)
    xn = x.detach().to("neuron").requires_grad_()
    for t in (x, xn):
        t[..., -1, :].square().sum().backward()
    torch.testing.assert_close(xn.grad.cpu(), x.grad)
