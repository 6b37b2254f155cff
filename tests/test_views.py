"""Views alias their base, in-place ops through views, out=, resize_, set_,
version counters (item 7). Every result is compared with the same code on CPU."""

import pytest
import torch


def both(fn, *shape):
    """Run fn on a CPU tensor and on a neuron copy of it; compare results and bases."""
    base = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
    n = base.to("neuron")
    r_cpu, r_neu = fn(base.clone()), fn(n)
    return r_cpu, r_neu, n


VIEWS = {
    "view": lambda t: t.view(-1),
    "reshape": lambda t: t.reshape(4, 6),
    "transpose": lambda t: t.transpose(0, 1),
    "permute": lambda t: t.permute(2, 0, 1),
    "slice": lambda t: t[1:, ::2],
    "select": lambda t: t[1],
    "index_view": lambda t: t[..., 1],
    "expand": lambda t: t[:1].expand(5, 3, 4),
    "unsqueeze": lambda t: t.unsqueeze(1),
    "squeeze": lambda t: t[:1].squeeze(0),
    "unfold": lambda t: t.view(-1).unfold(0, 4, 2),
    "diagonal": lambda t: t[0].diagonal(),
    "as_strided": lambda t: t.as_strided((2, 2), (5, 1), 3),
    "narrow": lambda t: t.narrow(2, 1, 2),
    "split": lambda t: t.split(1, dim=0)[1],
    "chunk": lambda t: t.chunk(2, dim=2)[1],
    "unbind": lambda t: t.unbind(1)[2],
    "T": lambda t: t[0].T,
    "mT": lambda t: t.mT,
    "flatten": lambda t: t.flatten(),
    "movedim": lambda t: t.movedim(0, 2),
    "view_dtype": lambda t: t.view(torch.int32),
}


@pytest.mark.parametrize("name", sorted(VIEWS))
def test_view_aliases_base_and_writes_through(name):
    fn = VIEWS[name]
    r_cpu, r_neu, base = both(fn, 2, 3, 4)
    assert r_neu._base is not None or r_neu.data_ptr() >= base.data_ptr()
    assert r_neu.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    assert r_neu.stride() == r_cpu.stride() and r_neu.shape == r_cpu.shape
    torch.testing.assert_close(r_neu.cpu(), r_cpu)
    if name == "expand":
        return  # writing through an expanded view is refused on CPU too
    cpu_base = torch.arange(24.0).reshape(2, 3, 4)
    cpu_view = fn(cpu_base)
    if cpu_view.dtype == torch.int32:
        cpu_view.fill_(7)
        r_neu.fill_(7)
    else:
        cpu_view.mul_(-1).add_(0.5)
        r_neu.mul_(-1).add_(0.5)
    torch.testing.assert_close(base.cpu(), cpu_base)


def test_setitem_and_indexing():
    c = torch.zeros(4, 5)
    n = c.to("neuron")
    for t in (c, n):
        t[1, 2:4] = 3.0
        t[:, 0] += 1
        t[t > 2] = -1
        t[torch.tensor([0, 3])] = 9.0
    torch.testing.assert_close(n.cpu(), c)
    idx = torch.tensor([3, 0, 0])
    torch.testing.assert_close(n[idx].cpu(), c[idx])  # advanced indexing copies
    torch.testing.assert_close(n[idx.to("neuron")].cpu(), c[idx])


def test_out_variants():
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    out = torch.empty(3, 4, device="neuron")
    r = torch.add(a.neuron(), b.neuron(), out=out)
    assert r is out
    torch.testing.assert_close(out.cpu(), a + b)
    # out= with the wrong size is resized, as on CPU.
    out2 = torch.empty(0, device="neuron")
    torch.mm(a.neuron(), b.t().neuron(), out=out2)
    assert out2.shape == (3, 3)
    torch.testing.assert_close(out2.cpu(), a @ b.t())
    # out= into a view of a bigger tensor writes into the base.
    big = torch.zeros(2, 3, 4, device="neuron")
    torch.mul(a.neuron(), 2, out=big[1])
    torch.testing.assert_close(big[1].cpu(), a * 2)
    assert big[0].abs().sum().item() == 0


def test_resize_and_set():
    n = torch.arange(6.0, device="neuron")
    n.resize_(2, 3)
    assert n.shape == (2, 3)
    torch.testing.assert_close(n.cpu(), torch.arange(6.0).reshape(2, 3))
    n.resize_(4, 4)  # grows the storage, keeps the data
    assert n.untyped_storage().nbytes() >= 64
    torch.testing.assert_close(n.view(-1)[:6].cpu(), torch.arange(6.0))
    src = torch.arange(10.0, device="neuron")
    t = torch.empty(0, device="neuron")
    t.set_(src)
    assert t.data_ptr() == src.data_ptr()
    t.set_(src.untyped_storage(), 2, (2, 2), (4, 1))
    torch.testing.assert_close(t.cpu(), torch.tensor([[2.0, 3.0], [6.0, 7.0]]))
    t.add_(100)
    assert src[2].item() == 102.0


def test_version_counter_detects_bad_inplace_like_cpu():
    for device in ("cpu", "neuron"):
        a = torch.randn(3, requires_grad=True, device=device)
        b = a.sigmoid()
        c = b * 2
        v = b._version
        b.mul_(2)  # sigmoid's backward needs b
        assert b._version == v + 1
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            c.sum().backward()
        x = torch.zeros(4, device=device)
        view = x[1:3]
        view.add_(1)
        assert x._version == view._version == 1


def test_inplace_metadata_ops_change_only_metadata():
    import torchneuron

    c = torch.arange(12.0).reshape(3, 1, 4)
    n = c.neuron()
    torchneuron.reset_stats()
    for t in (c, n):
        t.squeeze_(1)
        t.t_()
        t.unsqueeze_(0)
        t.transpose_(0, 2)
        t.as_strided_((2, 2), (1, 2))
    assert n.shape == c.shape and n.stride() == c.stride()
    torch.testing.assert_close(n.cpu(), c)
    assert torchneuron.fallback_ops() == {} and torchneuron.execution_stats()["ops_compiled"] == 0


# -- how lowered executables take views of their flat inputs ---------------------

def _random_view(rng):
    """A random chain of views of a fresh tensor: (flat buffer, view)."""
    shape = [int(rng.integers(1, 6)) for _ in range(int(rng.integers(1, 5)))]
    flat = torch.arange(float(torch.Size(shape).numel() + 7))
    x = flat[int(rng.integers(0, 8)):][: torch.Size(shape).numel()].view(shape)
    for _ in range(int(rng.integers(0, 4))):
        kind = int(rng.integers(0, 6))
        d = int(rng.integers(0, x.dim())) if x.dim() else 0
        if kind == 0 and x.dim() >= 2:
            x = x.transpose(d, (d + 1) % x.dim())
        elif kind == 1 and x.dim():
            start = int(rng.integers(0, x.shape[d]))
            x = x.narrow(d, start, int(rng.integers(1, x.shape[d] - start + 1)))
        elif kind == 2:
            x = x.unsqueeze(d).expand(*x.shape[:d], int(rng.integers(1, 4)), *x.shape[d:])
        elif kind == 3 and x.dim():
            x = x[(slice(None),) * d + (slice(None, None, int(rng.integers(1, 4))),)]
        elif kind == 4 and x.dim() >= 2:
            x = x.select(d, 0)
        elif kind == 5 and x.dim() and x.shape[-1] >= 2:
            x = x.unfold(x.dim() - 1, 2, 1)  # overlapping: as_strided stays
    return flat, x


def test_strided_view_matches_as_strided():
    import numpy as np

    from torchneuron.lowering.strided import layout_of, strided_view

    rng = np.random.default_rng(0)
    as_layout = 0
    for _ in range(2000):
        flat, x = _random_view(rng)
        want = flat.as_strided(x.shape, x.stride(), x.storage_offset())
        got = strided_view(flat, x.shape, x.stride(), x.storage_offset())
        assert torch.equal(got, want), (x.shape, x.stride(), x.storage_offset())
        as_layout += layout_of(tuple(x.shape), x.stride(), x.storage_offset(), flat.shape[0]) is not None
    assert as_layout > 1600  # all but overlapping and oddly stepped views
    # What the demo's backward graphs take: a transposed weight, a q/k/v split, a broadcast.
    assert layout_of((256, 256), (1, 256), 0, 65536) is not None
    assert layout_of((8, 32, 64), (6144, 192, 1), 64, 8 * 32 * 192) is not None
    assert layout_of((4, 4), (0, 1), 0, 4) is not None


def _lowered_view(shape, stride, offset, length, write=False):
    from torchneuron.lowering.graph import export_to_mlir
    from torchneuron.lowering.strided import strided_index, strided_view

    class Take(torch.nn.Module):
        def forward(self, flat, out):
            if write:  # as an executable writes through a strided view of its input
                flat.index_put_((strided_index(shape, stride, offset).reshape(-1),), out)
            else:
                out.copy_((strided_view(flat, shape, stride, offset) * 2).reshape(-1))
            return ()

    n = torch.Size(shape).numel()
    return export_to_mlir(Take(), [torch.zeros(length), torch.zeros(n)])


@pytest.mark.parametrize("shape, stride, offset, length", [
    ((256, 256), (1, 256), 0, 65536),  # a transposed weight
    ((8, 32, 64), (6144, 192, 1), 64, 8 * 32 * 192),  # k of a q/k/v split
    ((4, 8), (16, 1), 8, 64),  # a column block
])
def test_lowered_views_are_layout_ops_not_gathers(shape, stride, offset, length):
    """A view of an executable's flat input is slices and a permute, and a
    write through one a scatter at computed positions: as_strided (and
    slice's own decomposition into it) lowered to a gather through constant
    index tensors as large as the view (3 x 512 KiB for a 256x256 transpose)."""
    read = _lowered_view(shape, stride, offset, length)
    assert "index.Tensor" not in read and "dense_resource" not in read and len(read) < 20000
    written = _lowered_view(shape, stride, offset, length, write=True)
    assert "index_put" in written and "dense_resource" not in written and len(written) < 20000


def test_transposed_and_sliced_arguments_match_cpu():
    a = torch.randn(48, 32)
    qkv = torch.randn(4, 8, 96)
    q, k, v = qkv.split(32, dim=-1)
    got = (a.to("neuron").t() @ a.to("neuron")).cpu()
    torch.testing.assert_close(got, a.t() @ a)
    nq, nk, nv = qkv.to("neuron").split(32, dim=-1)
    torch.testing.assert_close((nq @ nk.transpose(-1, -2) + nv[..., :8].sum()).cpu(),
                               q @ k.transpose(-1, -2) + v[..., :8].sum())
    w = qkv.to("neuron")
    w[:, :, 32:64].mul_(2)  # an in-place write through a column block
    qkv[:, :, 32:64].mul_(2)
    torch.testing.assert_close(w.cpu(), qkv)
