"""The Cake session from Python: the same exactly-once contract as the C++ one."""

import numpy as np
import pytest

import kvtier
from conftest import small_layout
from test_client import keys_of, payloads


@pytest.fixture
def cached(client):
    lay = small_layout(model_id="pytest-prefill")
    ns = client.register_layout(lay).namespace_id
    keys = keys_of(ns, 8, lay, seed=30)
    data = payloads(lay, 8, seed=30)
    client.put(ns, keys[:6], data[:6])  # h = 6 of 8.
    return lay, ns, keys, data


def test_streamed_chunks_land_in_dest_and_cover_the_prefix_once(client, cached):
    lay, ns, keys, data = cached
    dest = np.zeros((8, lay.chunk_bytes // 4), np.float32)
    # A worker that computes nothing while the daemon streams: everything is streamed.
    with client.prefill(ns, keys, dest=dest, compute_estimate=(10.0, 0.0)) as s:
        assert s.plan.cached_prefix == 6 and len(s.plan.tiers) == 6
        assert s.plan.chunk_bytes == lay.chunk_bytes
        r = s.finish()
    assert r.cached_prefix == 6
    assert r.first_streamed == 0 and r.reason == "ALL_STREAMED"
    assert r.sources == ["streamed"] * 6 and r.chunks_streamed == 6
    assert (r.compute_begin, r.compute_end) == (0, 0)
    for i in range(6):
        assert np.array_equal(dest[i], data[i]), i
    assert not dest[6:].any()  # Uncached chunks are the worker's.


def test_dest_in_a_shared_buffer_is_written_by_the_daemon(client, cached):
    # dest in client.shared_buffer() memory: the daemon copies the streamed chunks into
    # it (PrefillOpen.target) and no chunk bytes come over the stream.
    lay, ns, keys, data = cached
    buf = client.shared_buffer(8 * lay.chunk_bytes)
    dest = np.frombuffer(buf, dtype=np.float32)[:8 * lay.chunk_bytes // 4].reshape(8, -1)
    with client.prefill(ns, keys, dest=dest, compute_estimate=(10.0, 0.0)) as s:
        r = s.finish()
    assert r.path == "shared_memory"
    assert r.first_streamed == 0 and r.chunks_streamed == 6
    for i in range(6):
        assert np.array_equal(dest[i], data[i]), i
    assert not dest[6:].any()
    # The same into Python's own memory takes the stream.
    own = np.zeros((8, lay.chunk_bytes // 4), np.float32)
    with client.prefill(ns, keys, dest=own, compute_estimate=(10.0, 0.0)) as s:
        r = s.finish()
    assert r.path == "stream"
    assert np.array_equal(own[:6], dest[:6])


def test_worker_that_computes_first_meets_the_stream(client, cached):
    lay, ns, keys, data = cached
    got = {}
    with client.prefill(ns, keys, on_chunk=lambda i, b, t: got.setdefault(i, (b, t)),
                        use_forecast=False, max_bytes_per_second=1) as s:
        # A 1 byte/s cap: the daemon cannot finish a chunk, so the worker computes all of
        # [0, h) and reports it; Done then says MET (or CLIENT_DONE) with s = h.
        i = 0
        while i < s.plan.cached_prefix and s.should_compute(i):
            s.report_computed(i)
            i += 1
        r = s.finish()
    assert r.first_streamed + r.chunks_streamed == 6
    assert set(got) == set(range(r.first_streamed, 6))
    for k, (b, t) in got.items():
        assert b == data[k].tobytes() and t == kvtier.Tier.RAM
    assert r.computed_reported == i
    assert r.sources[:r.first_streamed] == ["computed"] * r.first_streamed


def test_nothing_cached(client):
    lay = small_layout(model_id="pytest-prefill-empty")
    ns = client.register_layout(lay).namespace_id
    with client.prefill(ns, keys_of(ns, 3, lay, seed=31)) as s:
        assert s.plan.cached_prefix == 0
        r = s.finish()
    assert r.reason == "NOTHING_CACHED" and r.first_streamed == 0


def test_bad_prefill_input(client, cached):
    lay, ns, keys, data = cached
    with pytest.raises(kvtier.InvalidArgumentError, match="dest"):
        client.prefill(ns, keys, dest=bytearray(lay.chunk_bytes))
    with pytest.raises(kvtier.InvalidArgumentError, match="one of dest, on_chunk"):
        client.prefill(ns, keys, dest=bytearray(8 * lay.chunk_bytes), on_chunk=print)
    with pytest.raises(kvtier.NotFoundError):
        client.prefill(999, keys)
    with pytest.raises(kvtier.InvalidArgumentError, match="a_seconds"):
        client.prefill(ns, keys, compute_estimate=(-1.0, 0.0))


def test_a_closed_session_lets_go_of_dest_and_its_callbacks(client, cached):
    """Once the session is closed its dest is no longer exported and its callback no
    longer held: a bytearray dest can grow again, and a worker whose on_chunk is its
    own method (holding the session) is collected. Both were held until the session
    object itself went, which such a cycle never lets happen."""
    import gc
    import weakref
    lay, ns, keys, data = cached
    dest = bytearray(8 * lay.chunk_bytes)
    with client.prefill(ns, keys, dest=dest, compute_estimate=(10.0, 0.0)) as s:
        assert s.finish().chunks_streamed == 6
    dest.extend(b"x")  # BufferError while the session kept it exported.
    assert len(dest) == 8 * lay.chunk_bytes + 1

    class Worker:
        def __init__(self):
            self.chunks = []
            self.session = client.prefill(ns, keys, on_chunk=self.on_chunk,
                                          compute_estimate=(10.0, 0.0))

        def on_chunk(self, i, b, t):
            self.chunks.append(i)

    w = Worker()
    with w.session:
        w.session.finish()
    assert sorted(w.chunks) == list(range(6))
    gone = weakref.ref(w)
    del w
    gc.collect()
    assert gone() is None


def test_a_session_never_closed_in_a_cycle_is_collected(client, cached):
    """A worker that keeps its session and passes its own method as on_chunk, and never
    closes it, is a cycle through the native session. The collector once could not see
    into it, so the session, its thread and its call lived until the process exited;
    now collecting the worker destroys the session, which cancels the call."""
    import gc
    import weakref
    lay, ns, keys, data = cached

    class Worker:
        def __init__(self):
            self.chunks = []
            self.session = client.prefill(ns, keys, on_chunk=self.on_chunk,
                                          use_forecast=False, max_bytes_per_second=1)

        def on_chunk(self, i, b, t):
            self.chunks.append(i)

    w = Worker()
    native = weakref.ref(w.session._native)
    gone = weakref.ref(w)
    del w
    gc.collect()
    # Destroyed: its call was cancelled and its reader thread joined.
    assert gone() is None and native() is None


def test_on_chunk_that_raises_fails_the_session(client, cached):
    lay, ns, keys, data = cached
    calls = []

    def boom(i, b, t):
        calls.append(i)
        raise RuntimeError("worker could not take chunk")

    with client.prefill(ns, keys, on_chunk=boom, compute_estimate=(10.0, 0.0)) as s:
        with pytest.raises(kvtier.InternalError, match="worker could not take chunk"):
            s.finish()
        # The session ended at the first failure: no chunk after it was streamed to a
        # callback that cannot take it (it once went on with every cached chunk), and
        # the worker computes them all.
        assert len(calls) == 1, calls
        assert all(s.should_compute(i) for i in range(len(keys)))


_DROPPED_INSIDE_ITS_CALLBACK = r"""
import sys, threading, time, weakref
import numpy as np
import kvtier

client = kvtier.Client(sys.argv[1], connect_timeout=30)
lay = kvtier.Layout(model_id="pytest-prefill-drop", dtype="float32", num_layers=4,
                    num_kv_heads=2, head_dim=8, tokens_per_chunk=16)
ns = client.register_layout(lay).namespace_id
keys = kvtier.chunk_keys(ns, np.arange(4 * lay.tokens_per_chunk), lay.tokens_per_chunk)
client.put(ns, keys, [np.full(lay.chunk_bytes // 4, i, np.float32) for i in range(4)])

holder, refused, ready, dropped = {}, [], threading.Event(), threading.Event()

def on_chunk(i, data, tier):
    if dropped.is_set():
        return
    ready.wait()
    s = holder["session"]
    for method in (s.finish, s.close):
        try:
            method()
        except kvtier.FailedPreconditionError as e:
            refused.append(method.__name__)
            assert "on_chunk" in str(e), e
    del s
    holder.clear()  # The last reference to the session goes, on its reader thread.
    dropped.set()

def worker():
    s = client.prefill(ns, keys, on_chunk=on_chunk, compute_estimate=(10.0, 0.0))
    native = weakref.ref(s._native)
    holder["session"] = s
    del s
    ready.set()
    deadline = time.monotonic() + 60
    while native() is not None and time.monotonic() < deadline:
        pass  # Polls a condition.
    assert dropped.is_set()
    assert native() is None, "the session was never destroyed"
    # native() is None from the start of its destruction: wait for the end.
    for other in threading.enumerate():
        if other.name == "kvtier-prefill-release":
            other.join()
    assert refused == ["finish", "close"], refused
    done.append(True)

# A worker thread, while the main thread only waits for it (a release that needed the
# main thread, such as a pending call, would never come).
done = []
t = threading.Thread(target=worker)
t.start()
t.join()
assert done == [True]
print("ok", flush=True)
"""


def test_a_result_stands_when_the_daemon_ends_the_call_after_done(tmp_path):
    """kvtierd shutting down mid-session sends Done{SHUTTING_DOWN} and then ends the call
    UNAVAILABLE. finish()'s result stands, and leaving the session's `with` once raised
    that UNAVAILABLE: a worker took the session as failed and recomputed the chunks it
    had been sent and verified. close() now raises nothing and keeps the error."""
    import os
    import signal
    from kvtier.testing import Daemon
    d = Daemon(str(tmp_path), args=["--ram-capacity=64MiB", "--write-mode=ram-only"])
    try:
        c = kvtier.Client(d.target, connect_timeout=30)
        lay = small_layout(model_id="pytest-prefill-shutdown")
        ns = c.register_layout(lay).namespace_id
        keys = keys_of(ns, 8, lay, seed=31)
        data = payloads(lay, 8, seed=31)
        c.put(ns, keys, data)
        got = {}

        def on_chunk(i, chunk, tier):
            got[i] = bytes(chunk)
            if i == 5:
                os.kill(d.proc.pid, signal.SIGTERM)

        # The worker computes nothing while the daemon streams from the top, slowly
        # (two chunks a second): the shutdown lands mid-stream.
        with c.prefill(ns, keys[:8], on_chunk=on_chunk, compute_estimate=(100.0, 0.0),
                       max_bytes_per_second=2 * lay.chunk_bytes) as s:
            r = s.finish()
        assert r.reason == "SHUTTING_DOWN", r.detail
        assert isinstance(s.call_error, kvtier.UnavailableError), s.call_error
        assert 1 <= r.first_streamed <= 5
        assert sorted(got) == list(range(r.first_streamed, 8))
        for i in got:
            assert got[i] == data[i].tobytes(), i
    finally:
        d.close()


def test_a_session_dropped_inside_its_own_callback_is_destroyed_elsewhere(daemon):
    """A worker may let go of its session from on_chunk (on the session's reader
    thread). Destroying it there joined the thread from itself: std::terminate. The
    session is now destroyed on a thread of its own, after the callback returned; finish()
    and close() from the callback, which would wait for that same thread, raise
    FailedPreconditionError. Run in a child: the failure it guards against aborts."""
    import os
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _DROPPED_INSIDE_ITS_CALLBACK, daemon.target],
                         capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert out.returncode == 0 and out.stdout.split() == ["ok"], (out.returncode, out.stderr)
