"""Streams are separate timelines on the device, ordered only by events and
waits (issue 14). `hold(stream)` holds a stream's device work back behind a
gate the test opens, so the tests see what runs before what on the device.

Every op a held test uses is compiled first (`_warm`): an op on the host
fallback waits for every stream on the host. `release_after` opens each gate
from a timer, so a mistake fails a test instead of hanging it."""

import pytest
import torch

import torchneuron
from torchneuron.runtime.errors import NeuronAsyncError
from torchneuron.runtime.streams import hold

N = 384  # large enough that launches queue on the timelines, not inline
# A held stream opens by itself after this long, so a broken test cannot hang; long enough for
# what the held scenario still compiles on Vulkan (lavapipe: seconds an op under load).
_SAFETY = 180.0


def _inputs():
    x, w = torch.randn(N, N), torch.randn(N, N)
    return x, w, x.to("neuron"), w.to("neuron")


def _warm(fn):
    """Run fn(x, w) until every op and graph in it is compiled, in either eager
    mode, on other inputs than the test's: a block the allocator hands out
    again must not already hold the right values."""
    _, _, xn, wn = _inputs()
    for _ in range(2):
        fn(xn, wn)
        torchneuron.wait_for_compiles(timeout=600)
    fn(xn, wn)
    torch.neuron.synchronize()


def _producer(x, w):
    return (x @ w).relu()


def _consumer(y, w):
    return y * w + y


def _pipeline(x, w):
    return _consumer(_producer(x, w), w)


@pytest.fixture(params=["op", "adaptive"])
def mode(request):
    with torchneuron.eager_mode(request.param):
        yield request.param


def _event_ordered(xn, wn, s1, s2, _):
    with torch.neuron.stream(s1):
        y = _producer(xn, wn)
        done = torch.neuron.Event()
        done.record()
    with torch.neuron.stream(s2):
        s2.wait_event(done)
        z = _consumer(y, wn)
    return done, z


def test_event_orders_two_streams_while_the_first_is_held(mode):
    x, w, xn, wn, s1, s2, gate, (done, z) = _run_held(_event_ordered)
    torch.testing.assert_close(z.cpu(), _pipeline(x, w), rtol=1e-4, atol=1e-3)
    assert torch.equal(xn.cpu(), x) and torch.equal(wn.cpu(), w)


def _run_held(scenario, check=None):
    """_held, checking what must hold while the gate is closed, then opening it."""
    s1, s2 = torch.neuron.Stream(), torch.neuron.Stream()
    _warm(lambda x, w: scenario(x, w, s1, s2, None))
    x, w, xn, wn = _inputs()
    with hold(s1, release_after=_SAFETY) as gate:
        result = scenario(xn, wn, s1, s2, gate)
        assert not s1.query()  # the held stream's work has not run
        if check is not None:
            check(s1, s2, result)
        else:
            assert not s2.query()  # its work waits for the held stream, on the device
    torch.neuron.synchronize()
    return x, w, xn, wn, s1, s2, gate, result


def _unordered(xn, wn, s1, s2, gate):
    with torch.neuron.stream(s1):
        y = _producer(xn, wn)
    with torch.neuron.stream(s2):
        u = xn * wn
        stale = _consumer(y, wn)  # no wait: reads y before s1 writes it
        s2.synchronize()  # s2's work finishes while s1 is still held
    return y, u, stale


def test_streams_without_an_event_overlap(mode):
    def check(s1, s2, result):
        assert s2.query() and not s1.query()

    x, w, xn, wn, s1, s2, gate, (y, u, stale) = _run_held(_unordered, check)
    torch.testing.assert_close(u.cpu(), x * w)
    expected = _pipeline(x, w)
    assert not torch.allclose(stale.cpu(), expected, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(_consumer(y, wn).cpu(), expected, rtol=1e-4, atol=1e-3)


def _after_stream(xn, wn, side, _, __):
    with torch.neuron.stream(side):
        y = _producer(xn, wn)
    torch.neuron.current_stream().wait_stream(side)
    return _consumer(y, wn)  # on the default stream, after the side stream


def test_wait_stream_orders_after_all_its_work(mode):
    def check(s1, s2, z):
        assert not torch.neuron.current_stream().query()

    x, w, xn, wn, s1, s2, gate, z = _run_held(_after_stream, check)
    torch.testing.assert_close(z.cpu(), _pipeline(x, w), rtol=1e-4, atol=1e-3)


def test_a_block_another_stream_uses_is_not_reused_early():
    x, w, xn, wn = _inputs()
    _warm(lambda x, w: x * w + w)
    side = torch.neuron.Stream()
    # The block cache holds at most 64 MiB; earlier tests may have filled it,
    # and a block that does not fit goes back to the host.
    torch.neuron.empty_cache()
    # Without a stream holding it, a freed block is handed out again.
    t = torch.empty(N, N, device="neuron")
    address = t.data_ptr()
    del t
    assert torch.empty(N, N, device="neuron").data_ptr() == address
    used = xn.clone()
    address = used.data_ptr()
    with hold(side, release_after=_SAFETY) as gate:
        with torch.neuron.stream(side):
            product = used * wn + wn
        used.record_stream(side)
        del used
        fresh = [torch.empty(N, N, device="neuron") for _ in range(4)]
        assert address not in [f.data_ptr() for f in fresh]
        gate.release()
    torch.neuron.synchronize()
    torch.testing.assert_close(product.cpu(), x * w + w)


def test_elapsed_time_is_positive_and_grows_with_the_work():
    _, _, xn, wn = _inputs()
    _warm(lambda x, w: x @ w)
    s = torch.neuron.Stream()
    with torch.neuron.stream(s):
        xn @ wn  # the stream's first launch starts its timeline: not part of what is timed
    s.synchronize()
    with torch.neuron.stream(s):
        start, middle, end = (torch.neuron.Event(enable_timing=True) for _ in range(3))
        start.record()
        xn @ wn
        middle.record()
        # 48x the work: a CI machine shared by two test workers stalls for milliseconds at a time
        for _ in range(48):
            xn @ wn
        end.record()
    end.synchronize()
    little, much = start.elapsed_time(middle), middle.elapsed_time(end)
    assert 0 < little < much
    with pytest.raises((RuntimeError, ValueError), match="enable_timing"):
        untimed = torch.neuron.Event()
        untimed.record()
        start.elapsed_time(untimed)


def test_failure_on_a_side_stream_is_raised_at_the_next_sync_with_its_line(mode):
    _, _, xn, _ = _inputs()
    rows = torch.tensor([1, 2]).to("neuron")
    bad = torch.tensor([1, N + 5]).to("neuron")
    _warm(lambda x, w: x[rows])
    s = torch.neuron.Stream()
    with torch.neuron.stream(s):
        xn[bad]  # the line the error names
    line = test_failure_on_a_side_stream_is_raised_at_the_next_sync_with_its_line.__code__.co_firstlineno + 7
    # (compiled: "out of range"; on the host, while it compiles: PyTorch's "out of bounds")
    with pytest.raises(NeuronAsyncError, match=rf"test_streams.py:{line}.*out of (range|bounds)"):
        torch.neuron.synchronize()
    torch.testing.assert_close((xn * xn).cpu(), xn.cpu() * xn.cpu())  # still usable


def test_earliest_failure_across_streams_is_raised_first(mode):
    s1, s2 = torch.neuron.Stream(), torch.neuron.Stream()
    _warm(lambda x, w: _event_ordered(x, w, s1, s2, None))
    _, _, xn, wn = _inputs()
    first = _producer.__code__.co_firstlineno + 1  # where the held stream's first op is issued
    gate = hold(s1, release_after=_SAFETY)
    _event_ordered(xn, wn, s1, s2, gate)  # s2's work fails too: it waits for the failed work
    gate.fail("injected device fault")
    with pytest.raises(NeuronAsyncError, match="injected device fault") as raised:
        torch.neuron.synchronize()
    assert f"test_streams.py:{first}" in str(raised.value)
    assert f"stream {s1.stream_id}" in str(raised.value)
    torch.neuron.synchronize()  # reported once; both streams work again
    for s in (s1, s2):
        with torch.neuron.stream(s):
            torch.testing.assert_close(_producer(xn, wn).cpu(), _producer(xn.cpu(), wn.cpu()), rtol=1e-4, atol=1e-3)


def test_event_synchronize_raises_the_failure_of_the_work_it_waits_for(mode):
    s = torch.neuron.Stream()
    _warm(lambda x, w: _producer(x, w))
    _, _, xn, wn = _inputs()
    gate = hold(s, release_after=_SAFETY)
    with torch.neuron.stream(s):
        _producer(xn, wn)
        done = s.record_event()
    gate.fail("injected device fault")
    with pytest.raises(NeuronAsyncError, match="injected device fault") as raised:
        done.synchronize()
    assert f"test_streams.py:{_producer.__code__.co_firstlineno + 1}" in str(raised.value)
    torch.neuron.synchronize()  # reported once


def test_stream_api_matches_cuda_shape():
    high, normal = torch.neuron.Stream(priority=-1), torch.neuron.Stream()
    assert high.priority == -1 and normal.priority == 0
    assert high != normal and high.device == torch.device("neuron:0")
    assert torch.Stream("neuron").device.type == "neuron"
    assert torch.neuron.current_stream() == torch.neuron.default_stream()
    with torch.neuron.stream(high):
        assert torch.neuron.current_stream() == high
        assert torch.accelerator.current_stream() == high
    with normal:
        assert torch.neuron.current_stream() == normal
    torch.accelerator.set_stream(normal)
    assert torch.neuron.current_stream() == normal
    torch.neuron.set_stream(torch.neuron.default_stream())
    with torch.neuron.device(1):
        assert torch.neuron.current_stream().device == torch.device("neuron:1")
    event = torch.neuron.Event(enable_timing=True, blocking=True)
    assert isinstance(event, torch.Event) and isinstance(event, torch.neuron.Event)
    assert event.query()  # never recorded: nothing to wait for
    event.record(normal)
    event.synchronize()
    assert event.query() and normal.query()
    normal.synchronize()


def test_adaptive_recording_is_cut_at_a_stream_switch():
    from torchneuron.adaptive import stats

    x, w, xn, wn = _inputs()
    with torchneuron.eager_mode("adaptive"):
        s = torch.neuron.Stream()
        before = stats.cut_reasons["stream switch"]
        a = xn * wn
        with torch.neuron.stream(s):
            b = xn + wn
        torch.neuron.current_stream().wait_stream(s)
        c = a - b
        torch.neuron.synchronize()
        assert stats.cut_reasons["stream switch"] >= before + 1  # a's graph, cut when b was recorded
    torch.testing.assert_close(c.cpu(), x * w - (x + w))
