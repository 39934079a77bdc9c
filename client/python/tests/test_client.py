"""Every call of kvtier.Client against a real kvtierd, the zero-copy fills and the errors."""

import os
import tracemalloc

import numpy as np
import pytest

import kvtier
from conftest import small_layout
from kvtier.testing import Daemon


def payloads(layout, n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(layout.chunk_bytes // 4).astype(np.float32) for _ in range(n)]


def keys_of(ns, n, layout, seed=0):
    return kvtier.chunk_keys(ns, np.arange(n * layout.tokens_per_chunk) + seed * 100003,
                             layout.tokens_per_chunk)


def test_register_is_idempotent_and_agrees_with_the_local_namespace_id(client, layout):
    r1 = client.register_layout(layout)
    r2 = client.register_layout(layout)
    assert r1.namespace_id == layout.namespace_id == r2.namespace_id
    assert r1.chunk_bytes == layout.chunk_bytes
    assert r2.already_registered


def test_put_lookup_get_round_trip(client, ns, layout):
    keys = keys_of(ns, 4, layout, seed=1)
    data = payloads(layout, 4, seed=1)
    assert client.lookup(ns, keys).prefix_hits == 0
    r = client.put(ns, keys[:3], data[:3], token_counts=[16] * 3)
    assert (r.stored, r.already_present, r.bytes) == (3, 0, 3 * layout.chunk_bytes)
    assert client.put(ns, keys[:1], data[:1]).already_present == 1  # Idempotent.
    lk = client.lookup(ns, keys)
    assert lk.prefix_hits == 3
    assert lk.tiers[:3] == [kvtier.Tier.RAM] * 3 and lk.tiers[3] == kvtier.Tier.ABSENT
    got = client.get(ns, keys)
    assert got[3] is None
    for g, d in zip(got[:3], data[:3]):
        assert g == d.tobytes()


@pytest.mark.parametrize("kind", ["bytes", "bytearray", "memoryview", "numpy", "torch"])
def test_buffers_of_every_kind(client, ns, layout, kind):
    seed = 20 + ["bytes", "bytearray", "memoryview", "numpy", "torch"].index(kind)
    keys = keys_of(ns, 2, layout, seed=seed)
    data = payloads(layout, 2, seed=seed)
    if kind == "torch":
        torch = pytest.importorskip("torch")
        src = [torch.from_numpy(d) for d in data]
        out = torch.zeros(2, layout.chunk_bytes // 4, dtype=torch.float32)
        ptr = out.data_ptr()
    elif kind == "numpy":
        src, out = data, np.zeros((2, layout.chunk_bytes // 4), np.float32)
    elif kind == "bytes":
        src, out = [d.tobytes() for d in data], [bytearray(layout.chunk_bytes) for _ in data]
    elif kind == "bytearray":
        src, out = [bytearray(d.tobytes()) for d in data], bytearray(2 * layout.chunk_bytes)
    else:
        src = [memoryview(d.tobytes()) for d in data]
        out = memoryview(bytearray(2 * layout.chunk_bytes))
    assert client.put(ns, keys, src).stored == 2
    r = client.get_into(ns, keys, out)
    assert r.found == [True, True] and r.bytes == 2 * layout.chunk_bytes
    if kind == "torch":
        assert out.data_ptr() == ptr  # Filled in place.
        flat = out.numpy().tobytes()
    elif isinstance(out, list):
        flat = b"".join(bytes(o) for o in out)
    else:
        flat = bytes(memoryview(out).cast("B")) if not isinstance(out, np.ndarray) else out.tobytes()
    assert flat == data[0].tobytes() + data[1].tobytes()


def test_get_into_fills_without_python_copies(client, ns):
    big = small_layout(model_id="pytest-big", num_layers=8, num_kv_heads=8, head_dim=128,
                       tokens_per_chunk=256, dtype="bfloat16")  # 8 MiB chunks.
    bns = client.register_layout(big).namespace_id
    keys = keys_of(bns, 4, big, seed=3)
    src = np.frombuffer(os.urandom(big.chunk_bytes), np.uint8)
    out = np.zeros(4 * big.chunk_bytes, np.uint8)
    tracemalloc.start()
    client.put(bns, keys, [src] * 4)
    client.get_into(bns, keys, out)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    # 32 MiB moved each way; a Python-side copy of even one chunk would show as 8 MiB.
    assert peak < (1 << 20), peak
    assert np.array_equal(out[-big.chunk_bytes:], src)


def test_layer_range_into_a_preallocated_buffer(client, ns, layout):
    keys = keys_of(ns, 2, layout, seed=4)
    data = payloads(layout, 2, seed=4)
    client.put(ns, keys, data)
    lb = layout.layer_bytes
    out = bytearray(2 * 2 * lb)
    r = client.get_into(ns, keys, out, layers=(1, 3))
    assert r.found == [True, True]
    assert out == b"".join(d.tobytes()[lb:3 * lb] for d in data)
    got = client.get(ns, keys, layers=(3, 4))
    assert got == [d.tobytes()[3 * lb:] for d in data]


def test_absent_keys_leave_their_slice_untouched(client, ns, layout):
    keys = keys_of(ns, 3, layout, seed=5)
    data = payloads(layout, 3, seed=5)
    client.put(ns, [keys[0], keys[2]], [data[0], data[2]])
    out = np.full((3, layout.chunk_bytes // 4), 7.0, np.float32)
    r = client.get_into(ns, keys, out)
    assert r.found == [True, False, True] and r.prefix_found == 1
    assert (out[1] == 7.0).all() and np.array_equal(out[2], data[2])


def test_pin_unpin_delete_clear_stats(client, layout):
    lay = small_layout(model_id="pytest-admin")
    ns = client.register_layout(lay).namespace_id
    keys = keys_of(ns, 3, lay, seed=6)
    client.put(ns, keys, payloads(lay, 3, seed=6))
    assert client.pin(ns, keys + keys_of(ns, 1, lay, seed=99), ttl_seconds=0) == (3, 1)
    stats = client.stats()
    ram = [t for t in stats.tiers if t.tier == kvtier.Tier.RAM][0]
    assert ram.pinned_bytes >= 3 * lay.chunk_bytes and stats.write_mode == "write-through"
    assert client.unpin(ns, keys) == 3
    assert client.delete(ns, keys[:1]) == 1
    assert client.lookup(ns, keys).prefix_hits == 0
    assert client.clear(ns) == 2
    assert client.lookup(ns, keys).tiers == [kvtier.Tier.ABSENT] * 3


# -- Bad input -------------------------------------------------------------------------

def test_wrong_sizes_and_dtypes_raise_before_anything_is_sent(client, ns, layout):
    keys = keys_of(ns, 2, layout, seed=7)
    good = payloads(layout, 2, seed=7)
    with pytest.raises(kvtier.InvalidArgumentError, match="buffers\\[1\\]: .* bytes"):
        client.put(ns, keys, [good[0], good[1][:-1]])
    with pytest.raises(kvtier.InvalidArgumentError, match="one per key"):
        client.put(ns, keys, good[:1])
    with pytest.raises(kvtier.InvalidArgumentError, match="float16"):
        client.put(ns, keys, [g.astype(np.float16) for g in good])
    assert client.lookup(ns, keys).prefix_hits == 0  # Nothing was stored.
    client.put(ns, keys, good)
    with pytest.raises(kvtier.InvalidArgumentError, match="out: .* bytes"):
        client.get_into(ns, keys, bytearray(layout.chunk_bytes))
    with pytest.raises(kvtier.InvalidArgumentError, match="not C-contiguous"):
        client.get_into(ns, keys, np.zeros((layout.chunk_bytes // 4, 2), np.float32).T)
    with pytest.raises(kvtier.InvalidArgumentError, match="read-only"):
        client.get_into(ns, keys, bytes(2 * layout.chunk_bytes))
    with pytest.raises(kvtier.InvalidArgumentError, match="16-byte|16 bytes"):
        client.lookup(ns, [b"short"])
    with pytest.raises(kvtier.InvalidArgumentError, match="layers"):
        client.get(ns, keys, layers=(2, 2))


def test_non_contiguous_and_device_tensors(client, ns, layout):
    torch = pytest.importorskip("torch")
    keys = keys_of(ns, 1, layout, seed=8)
    t = torch.zeros(layout.chunk_bytes // 4 * 2, dtype=torch.float32)[::2]
    with pytest.raises(kvtier.InvalidArgumentError, match="not contiguous"):
        client.put(ns, keys, [t])
    with pytest.raises(kvtier.InvalidArgumentError, match="bfloat16|float32"):
        client.put(ns, keys, [torch.zeros(layout.chunk_bytes // 2, dtype=torch.bfloat16)])


def test_a_buffer_of_the_wrong_size_for_an_unregistered_namespace_is_refused_by_size(daemon, layout):
    # A client that did not register the layout learns the size from the daemon's first
    # frame and stops before writing.
    with kvtier.Client(daemon.target) as a, kvtier.Client(daemon.target) as b:
        ns = a.register_layout(layout).namespace_id
        keys = keys_of(ns, 1, layout, seed=9)
        a.put(ns, keys, payloads(layout, 1, seed=9))
        out = bytearray(layout.chunk_bytes // 2)
        with pytest.raises(kvtier.InvalidArgumentError, match="out\\[0\\] holds"):
            b.get_into(ns, keys, [out])
        assert out == bytearray(len(out))


def test_unknown_namespace_is_not_found(client, layout):
    with pytest.raises(kvtier.NotFoundError) as e:
        client.lookup(12345, keys_of(12345, 1, layout))
    assert e.value.code == "NOT_FOUND" and not e.value.retryable
    assert "RegisterLayout" in e.value.message


def test_only_the_codes_the_contract_says_retry_are_retryable():
    """kvtier.proto's contract: RESOURCE_EXHAUSTED, UNAVAILABLE and ABORTED say retry;
    every other code, DEADLINE_EXCEEDED included (the same call times out again), not."""
    from kvtier import errors
    retryable = {name for num, name in errors._CODE_NAMES.items()
                 if num != 0 and errors.from_status(num, "x").retryable}
    assert retryable == {"RESOURCE_EXHAUSTED", "UNAVAILABLE", "ABORTED"}


def test_a_shared_buffer_larger_than_memory_is_invalid_not_retryable(client):
    for nbytes in (1 << 60, (1 << 64) - 1):
        with pytest.raises(kvtier.InvalidArgumentError) as e:
            client.shared_buffer(nbytes)
        assert not e.value.retryable and "memory" in e.value.message


def test_unreachable_target_is_unavailable():
    with pytest.raises(kvtier.UnavailableError) as e:
        kvtier.Client("127.0.0.1:1", connect_timeout=0.2)
    assert e.value.retryable
    lazy = kvtier.Client("127.0.0.1:1", rpc_deadline=5)
    with pytest.raises((kvtier.UnavailableError, kvtier.DeadlineExceededError)):
        lazy.stats()


def test_daemon_restart_mid_session(tmp_path):
    lay = small_layout(model_id="pytest-restart")
    with Daemon(str(tmp_path / "d"), args=["--write-mode=write-through"]) as d:
        c = kvtier.Client(d.target, rpc_deadline=10)
        ns = c.register_layout(lay).namespace_id
        keys = keys_of(ns, 2, lay, seed=11)
        data = payloads(lay, 2, seed=11)
        c.put(ns, keys, data)
        port = d.port
        d.kill()
        out = np.zeros((2, lay.chunk_bytes // 4), np.float32)
        with pytest.raises(kvtier.UnavailableError):
            c.get_into(ns, keys, out)
        d.start()
        # Same data directory, new port: a new client finds the write-through chunks.
        c2 = kvtier.Client(d.target, rpc_deadline=10)
        c2.register_layout(lay)
        r = c2.get_into(ns, keys, out)
        assert r.found == [True, True] and r.tiers == [kvtier.Tier.SSD] * 2
        assert np.array_equal(out[1], data[1])
        assert port > 0


def test_a_background_load_starts_before_close_can_see_it(client, ns, layout, monkeypatch):
    """close() joins every listed load. One listed but not started yet (its thread was
    started after the client's lock was let go) made close() raise RuntimeError and
    leave the loads after it running: a load's thread now starts under that lock."""
    import threading
    keys = keys_of(ns, 1, layout, seed=13)
    client.put(ns, keys, payloads(layout, 1, seed=13))
    locked_at_start = []
    start = threading.Thread.start

    def recording_start(self):
        if self.name == "kvtier-load":
            locked_at_start.append(client._lock.locked())
        start(self)

    monkeypatch.setattr(threading.Thread, "start", recording_start)
    h = client.start_get_into(ns, keys, np.zeros(layout.chunk_bytes // 4, np.float32))
    assert h.wait().found == [True]
    assert locked_at_start == [True]
    client.close()


def test_background_load_and_cancel(client, ns, layout):
    keys = keys_of(ns, 3, layout, seed=12)
    data = payloads(layout, 3, seed=12)
    client.put(ns, keys, data)
    out = np.zeros((3, layout.chunk_bytes // 4), np.float32)
    h = client.start_get_into(ns, keys, out, order="chunk")
    h.wait_layer(layout.num_layers - 1)
    assert h.wait().found == [True] * 3 and np.array_equal(out[2], data[2])
    # A load cancelled before it starts raises CancelledError and writes nothing.
    out2 = np.zeros_like(out)
    h2 = client.start_get_into(ns, keys, out2, order="chunk")
    h2.cancel()
    try:
        h2.wait()
        cancelled = False
    except kvtier.CancelledError:
        cancelled = True
    # Either the load finished before the cancel landed (then it is complete) or it
    # raised; never a partial load reported as complete.
    if not cancelled:
        assert np.array_equal(out2, out)


def test_a_finished_background_load_holds_neither_its_buffers_nor_its_client(daemon, layout):
    """A LoadHandle kept the caller's buffers after its load ended, and finished handles
    stayed listed on the client until the next start_get_into or close(): a bytearray
    loaded into could not be resized (BufferError), and a dropped client lived on in a
    cycle (client -> handle -> client) until the cyclic GC ran."""
    import gc
    import weakref
    c = kvtier.Client(daemon.target, connect_timeout=30)
    ns = c.register_layout(layout).namespace_id
    keys = keys_of(ns, 2, layout, seed=14)
    data = payloads(layout, 2, seed=14)
    c.put(ns, keys, data)
    for order in ("chunk", "layer"):
        ba = bytearray(2 * layout.chunk_bytes)
        h = c.start_get_into(ns, keys, ba, order=order)
        assert h.wait().found == [True, True]
        assert ba == b"".join(d.tobytes() for d in data)
        ba.extend(b"x")                            # The handle, still alive, lets go.
        del h
    ref = weakref.ref(c)
    gc.disable()
    try:
        h = c.start_get_into(ns, keys, bytearray(2 * layout.chunk_bytes), order="chunk")
        h.wait()
        h._thread.join()                           # Its thread holds it until it ends.
        del h, c
        assert ref() is None                       # Freed by reference counting alone.
    finally:
        gc.enable()


def test_start_get_into_checks_arguments_first_and_wait_layer_its_range(client, ns, layout):
    """start_get_into checked key lengths and the lease only on the load's thread, so a
    bad one started a load that failed later, though its arguments are said to be checked
    before it starts. wait_layer took layers the load does not fetch: below its range it
    returned at once, above it it returned success once the load ended."""
    keys = keys_of(ns, 2, layout, seed=15)
    client.put(ns, keys, payloads(layout, 2, seed=15))
    out = bytearray(2 * layout.chunk_bytes)
    for bad_keys, lease, match in (([keys[0], keys[1][:15]], 0, r"keys\[1\]: key must be 16"),
                                   ([keys[0], "k" * 16], 0, r"keys\[1\]: expected bytes"),
                                   (keys, -1, "lease")):
        with pytest.raises(kvtier.InvalidArgumentError, match=match):
            client.start_get_into(ns, bad_keys, out, lease=lease)
    lb = layout.layer_bytes
    h = client.start_get_into(ns, keys, bytearray(2 * 2 * lb), layers=(1, 3))
    for layer in (-1, 0, 3):
        with pytest.raises(kvtier.InvalidArgumentError, match="layer"):
            h.wait_layer(layer)
    h.wait_layer(2)
    assert h.wait().found == [True, True]
    with pytest.raises(kvtier.InvalidArgumentError, match=r"layers \[1, 3\)"):
        h.wait_layer(3)
    h = client.start_get_into(ns, keys, out, order="chunk")   # The layout's layers.
    assert h.wait().found == [True, True]
    h.wait_layer(layout.num_layers - 1)
    with pytest.raises(kvtier.InvalidArgumentError, match="layer"):
        h.wait_layer(layout.num_layers)


def test_layer_major_get_into_lands_every_layer_in_order(client, ns, layout):
    keys = keys_of(ns, 4, layout, seed=20)
    data = payloads(layout, 4, seed=20)
    client.put(ns, [keys[0], keys[1], keys[3]], [data[0], data[1], data[3]])
    out = np.full((4, layout.chunk_bytes // 4), 7.0, np.float32)
    lb = layout.layer_bytes // 4  # float32 elements per layer
    landed = []

    def on_layer(layer):
        # Layer `layer` of every found chunk is in; the next layer has not started.
        for i in (0, 1, 3):
            assert np.array_equal(out[i, layer * lb:(layer + 1) * lb],
                                  data[i][layer * lb:(layer + 1) * lb])
            if layer + 1 < layout.num_layers:
                assert (out[i, (layer + 1) * lb:] == 7.0).all()
        landed.append(layer)

    r = client.get_into(ns, keys, out, order="layer", on_layer=on_layer)
    assert landed == list(range(layout.num_layers))
    assert r.found == [True, True, False, True]
    assert r.bytes == 3 * layout.chunk_bytes
    assert (out[2] == 7.0).all()
    for i in (0, 1, 3):
        assert np.array_equal(out[i], data[i])
    # get(order="layer") assembles the same bytes.
    got = client.get(ns, keys, order="layer")
    assert got[2] is None
    assert [got[i] for i in (0, 1, 3)] == [data[i].tobytes() for i in (0, 1, 3)]


def test_layer_major_layer_range_and_background_load(client, ns, layout):
    keys = keys_of(ns, 3, layout, seed=21)
    data = payloads(layout, 3, seed=21)
    client.put(ns, keys, data)
    lb = layout.layer_bytes
    out = bytearray(3 * 2 * lb)
    landed = []
    client.get_into(ns, keys, out, layers=(1, 3), order="layer", on_layer=landed.append)
    assert landed == [1, 2]
    assert out == b"".join(d.tobytes()[lb:3 * lb] for d in data)

    full = np.zeros((3, layout.chunk_bytes // 4), np.float32)
    h = client.start_get_into(ns, keys, full, order="layer")
    h.wait_layer(0)
    n = lb // 4
    assert all(np.array_equal(full[i, :n], data[i][:n]) for i in range(3))
    assert h.wait().found == [True] * 3
    assert all(np.array_equal(full[i], data[i]) for i in range(3))


def test_layer_major_errors(client, ns, layout):
    keys = keys_of(ns, 2, layout, seed=22)
    client.put(ns, keys, payloads(layout, 2, seed=22))
    # on_layer raising stops the load and the exception comes back as it was raised.
    class Stop(Exception):
        pass

    def boom(layer):
        raise Stop(f"layer {layer}")

    out = bytearray(2 * layout.chunk_bytes)
    with pytest.raises(Stop, match="layer 0"):
        client.get_into(ns, keys, out, order="layer", on_layer=boom)
    # on_layer needs layer order; an unknown order is refused.
    with pytest.raises(kvtier.InvalidArgumentError, match="on_layer"):
        client.get_into(ns, keys, out, on_layer=print)
    with pytest.raises(kvtier.InvalidArgumentError, match="order"):
        client.get_into(ns, keys, out, order="diagonal")
    # The package checks buffer sizes of registered namespaces before the call; below
    # it, the native layer checks the daemon's pieces against each buffer: too small
    # fails at the first piece that does not fit, too large when the stream ends short.
    native = client._native
    with pytest.raises(kvtier.InvalidArgumentError, match="pass buffers"):
        native.get_into(ns, keys, [bytearray(layout.chunk_bytes - layout.layer_bytes)] * 2,
                        None, 1, None, 0, None)
    with pytest.raises(kvtier.InvalidArgumentError, match="pass buffers"):
        native.get_into(ns, keys, [bytearray(layout.chunk_bytes + layout.layer_bytes)] * 2,
                        None, 1, None, 0, None)


def test_lookup_lease_is_held_until_the_get_that_names_it(client, ns, layout):
    keys = keys_of(ns, 3, layout, seed=23)
    client.put(ns, keys[:2], payloads(layout, 2, seed=23))
    before = client.stats().leases
    lk = client.lookup(ns, keys, lease_seconds=30)
    assert lk.prefix_hits == 2 and lk.lease != 0
    s = client.stats()
    assert s.leases == before + 1 and s.lease_held_bytes >= 2 * layout.chunk_bytes
    out = np.zeros((2, layout.chunk_bytes // 4), np.float32)
    assert client.get_into(ns, keys[:2], out, order="layer", lease=lk.lease).found == [True] * 2
    assert client.stats().leases == before
    assert client.release_lease(ns, lk.lease) is False  # The Get ended it.
    # Released without a get; none for misses; a negative duration is refused.
    lk2 = client.lookup(ns, keys[:2], lease_seconds=30)
    assert client.release_lease(ns, lk2.lease) is True
    assert client.lookup(ns, keys[2:], lease_seconds=30).lease == 0
    assert client.lookup(ns, keys).lease == 0
    with pytest.raises(kvtier.InvalidArgumentError, match="lease_seconds"):
        client.lookup(ns, keys, lease_seconds=-1)


def test_crc32c_matches_the_standard_check_value():
    assert kvtier.crc32c(b"123456789") == 0xE3069283
    assert kvtier.crc32c(b"6789", kvtier.crc32c(b"12345")) == 0xE3069283


def test_same_host_shared_memory(client, ns, layout):
    # The fixture's daemon runs on this host with its region socket on (the default).
    assert client.data_path.startswith("shared memory"), client.data_path
    n = layout.chunk_bytes
    buf = client.shared_buffer(3 * n)
    view = np.frombuffer(buf, dtype=np.uint8)
    assert view.size >= 3 * n
    keys = keys_of(ns, 2, layout, seed=77)
    data = [p.tobytes() for p in payloads(layout, 2, seed=77)]
    view[:n] = np.frombuffer(data[0], dtype=np.uint8)
    view[n:2 * n] = np.frombuffer(data[1], dtype=np.uint8)
    assert client.put(ns, keys, [view[:n], view[n:2 * n]]).stored == 2
    assert client.get(ns, keys) == data  # Into Python's own memory: staged.
    out = view[2 * n:3 * n]
    r = client.get_into(ns, keys[1:], out)
    assert r.found == [True]
    assert out.tobytes() == data[1]
    assert client.stats().regions >= 1


def test_get_into_a_shared_buffer_is_written_by_the_daemon_directly(daemon, layout):
    # A fresh client: its only region is the shared buffer. A staged transfer would
    # register a second (the staging buffer), so the region count shows the path.
    with kvtier.Client(daemon.target) as c:
        ns = c.register_layout(layout).namespace_id
        before = c.stats().regions
        n = layout.chunk_bytes
        buf = c.shared_buffer(2 * n)
        assert c.stats().regions == before + 1
        view = np.frombuffer(buf, dtype=np.uint8)[:2 * n]
        keys = keys_of(ns, 2, layout, seed=91)
        data = [p.tobytes() for p in payloads(layout, 2, seed=91)]
        view[:n] = np.frombuffer(data[0], dtype=np.uint8)
        view[n:] = np.frombuffer(data[1], dtype=np.uint8)
        assert c.put(ns, keys, [view[:n], view[n:]], token_counts=[5, 6]).stored == 2
        view[:] = 0
        r = c.get_into(ns, keys, view)
        assert r.found == [True, True]
        assert r.token_counts == [5, 6]
        assert view.tobytes() == data[0] + data[1]
        # Layer-major into the same memory: on_layer(l) once layer l of both chunks is in.
        view[:] = 0
        seen = []
        per_layer = n // layout.num_layers

        def on_layer(l):
            for k in range(2):
                at = k * n + l * per_layer
                assert view[at:at + per_layer].tobytes() == data[k][l * per_layer:(l + 1) * per_layer]
            seen.append(l)
        r = c.get_into(ns, keys, view, order="layer", on_layer=on_layer)
        assert r.found == [True, True]
        assert seen == list(range(layout.num_layers))
        assert view.tobytes() == data[0] + data[1]
        # An absent key: its bytes stay as they were, and it is reported absent.
        view[:] = 7
        missing = keys_of(ns, 1, layout, seed=92)
        r = c.get_into(ns, [keys[0], missing[0]], view)
        assert r.found == [True, False]
        assert view[:n].tobytes() == data[0] and set(view[n:].tobytes()) == {7}
        # An exception in on_layer cancels the load and is raised as is.

        def boom(l):
            raise RuntimeError(f"layer {l}")
        with pytest.raises(RuntimeError, match="layer 0"):
            c.get_into(ns, keys, view, order="layer", on_layer=boom)
        assert c.stats().regions == before + 1  # Nothing was staged.


def test_stream_when_the_daemon_has_no_region_socket(tmp_path, layout):
    d = Daemon(str(tmp_path / "data"), args=["--shm-socket=off"])
    try:
        with kvtier.Client(d.target) as c:
            ns = c.register_layout(layout).namespace_id
            assert c.data_path.startswith("stream"), c.data_path
            assert "shm_socket = off" in c.data_path
            with pytest.raises(kvtier.FailedPreconditionError):
                c.shared_buffer(4096)
            keys = keys_of(ns, 1, layout, seed=5)
            data = [p.tobytes() for p in payloads(layout, 1, seed=5)]
            c.put(ns, keys, data)
            assert c.get(ns, keys) == data
    finally:
        d.close()


def test_device_memory_needs_a_daemon_with_a_gpu(tmp_path):
    # The device-memory calls reach the daemon and map its answers; a real GPU runs them
    # end to end (the C++ device_get_test covers the daemon's side on a fake device).
    d = Daemon(str(tmp_path / "data"),
               args=["--ram-capacity=64MiB", "--gpu=off"])
    try:
        with kvtier.Client(d.target, connect_timeout=30) as c:
            assert c.data_path.startswith("shared memory"), c.data_path
            with pytest.raises(kvtier.FailedPreconditionError, match="no GPU"):
                c.register_device_memory(b"\0" * 64, 1 << 20)
            layout = small_layout()
            ns = c.register_layout(layout).namespace_id
            keys = keys_of(ns, 1, layout)
            region = kvtier.DeviceRegion(region_id=1, token=2, nbytes=1 << 20)
            with pytest.raises(kvtier.FailedPreconditionError, match="not registered"):
                c.get_into_device(ns, keys, region)
            with pytest.raises(kvtier.InvalidArgumentError, match="on_layer"):
                c.get_into_device(ns, keys, region, on_layer=lambda layer: None)
            # record_events reaches the daemon, which records events only into GPU
            # memory it has registered.
            with pytest.raises(kvtier.InvalidArgumentError, match="record_events"):
                c.get_into_device(ns, keys, region, record_events=True)
            with pytest.raises(kvtier.FailedPreconditionError, match="no GPU"):
                c.register_device_memory(b"\0" * 64, 1 << 20, event_handles=[b"\0" * 64])
            # put_from_device: what the client checks itself, then the daemon's answer
            # for a region it does not have; nothing is stored.
            chunk = layout.chunk_bytes
            with pytest.raises(kvtier.InvalidArgumentError, match="one of each per key"):
                c.put_from_device(ns, keys, region, offsets=[], crc32cs=[])
            with pytest.raises(kvtier.InvalidArgumentError, match="does not fit"):
                c.put_from_device(ns, keys, region, offsets=[region.nbytes - chunk + 1],
                                  crc32cs=[0])
            with pytest.raises(kvtier.FailedPreconditionError, match="not registered"):
                c.put_from_device(ns, keys, region, offsets=[0], crc32cs=[0])
            assert c.lookup(ns, keys).prefix_hits == 0
            # A Prefill session into GPU memory: one destination, callbacks that fit it,
            # the chunks within the region; then the daemon's answer.
            with pytest.raises(kvtier.InvalidArgumentError, match="one of dest"):
                c.prefill(ns, keys, dest=bytearray(chunk), device_dest=(region, 0))
            with pytest.raises(kvtier.InvalidArgumentError, match="only with device_dest"):
                c.prefill(ns, keys, on_in_place=lambda i, tier: None)
            with pytest.raises(kvtier.InvalidArgumentError):
                c.prefill(ns, keys, device_dest=(region, region.nbytes - chunk + 1))
            c.put(ns, keys, [bytes(chunk)])
            with pytest.raises(kvtier.KvTierError) as no_gpu:
                with c.prefill(ns, keys, device_dest=(region, 0),
                               on_in_place=lambda i, tier: None) as s:
                    s.finish()
            assert isinstance(no_gpu.value, kvtier.FailedPreconditionError), no_gpu.value
            assert "not registered" in str(no_gpu.value)
            with pytest.raises(kvtier.NotFoundError):
                c.release_device_memory(region)
    finally:
        d.close()


def test_chain_puts_steer_a_prefix_policy_and_hints_answer_what_they_took(tmp_path):
    layout = small_layout(head_dim=128)  # 128 KiB chunks: the 512 KiB pool holds four.
    d = Daemon(str(tmp_path),  # ram-only makes no data dir of its own: give one that exists.
               args=["--write-mode=ram-only", "--ram-capacity=512KiB", "--ram-slot-size=128KiB",
                     "--eviction-policy=prefix-lru", "--hint-window-fraction=1"])
    try:
        with kvtier.Client(d.target, connect_timeout=30) as c:
            ns = c.register_layout(layout).namespace_id
            keys = keys_of(ns, 6, layout, seed=7)
            data = payloads(layout, 6, seed=7)
            assert c.put(ns, keys[:2], data[:2], chain_start=0).stored == 2
            # The rest of the same request, continuing the chain from chunk 2.
            assert c.put(ns, keys[2:4], data[2:4], chain_start=2, prev_key=keys[1]).stored == 2
            other = keys_of(ns, 1, layout, seed=8)
            c.put(ns, other, payloads(layout, 1, seed=8))
            tiers = c.lookup(ns, keys[:4]).tiers
            # The chain's tail made room, not its head (plain LRU would evict keys[0]).
            assert tiers[0] == kvtier.Tier.RAM and tiers[3] == kvtier.Tier.ABSENT

            with pytest.raises(kvtier.InvalidArgumentError, match="prev_key"):
                c.put(ns, keys[4:5], data[4:5], prev_key=keys[3])
            with pytest.raises(kvtier.InvalidArgumentError, match="chunk 0"):
                c.put(ns, keys[4:5], data[4:5], chain_start=0, prev_key=keys[3])
            with pytest.raises(kvtier.InvalidArgumentError, match="chain_start"):
                c.put(ns, keys[4:5], data[4:5], chain_start=-1)

            r = c.hint("scheduler", [(ns, keys[:2]), (ns, keys[4:6])])
            assert (r.requests_accepted, r.keys_accepted, r.truncated) == (2, 4, False)
            assert r.cached == 2 and r.prefetching == 0  # ram-only: nothing to prefetch.
            assert c.hint("scheduler", []).keys_accepted == 0
            with pytest.raises(kvtier.InvalidArgumentError, match="client_id"):
                c.hint("", [(ns, keys[:1])])
            with pytest.raises(kvtier.NotFoundError):
                c.hint("scheduler", [(ns + 1, keys[:1])])
    finally:
        d.close()


def test_malloc_tuning_option_is_validated_and_can_be_turned_off(daemon):
    # The tuning itself (faults per frame, once per process) is tested in C++
    # (tests/allocator_tuning_test.cc); here: the keyword reaches ClientOptions.
    with pytest.raises(kvtier.InvalidArgumentError, match="malloc_top_pad_bytes"):
        kvtier.Client(daemon.target, malloc_top_pad_bytes=(1 << 30) + 1)
    with kvtier.Client(daemon.target, malloc_top_pad_bytes=0, connect_timeout=30) as c:
        assert c.stats().tiers
    with pytest.raises(kvtier.InvalidArgumentError, match="malloc_arena_max"):
        kvtier.Client(daemon.target, malloc_arena_max=1025)


def test_a_daemon_left_running_dies_with_the_script(tmp_path):
    # A script that starts a Daemon and exits without stop() must not leave kvtierd
    # (and its RAM pool) behind. The child prints the daemon's pid, then exits.
    import subprocess
    import sys
    script = ("from kvtier.testing import Daemon\n"
              f"d = Daemon({str(tmp_path / 'data')!r}, args=['--ram-capacity=64MiB'])\n"
              "print(d.proc.pid, flush=True)\n")
    os.makedirs(tmp_path / "data")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ))
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout.split()[0])
    # Reaped by the finalizer before the child exited: no such process, not even a zombie.
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_misuse_raises_invalid_argument_not_python_errors(client, ns, layout):
    """errors.py promises a KvTierError for every error of a call: arguments the native
    layer cannot convert (negative or huge ints, None, wrong types) and durations that are
    no durations are InvalidArgumentError, never TypeError, RuntimeError or
    AttributeError."""
    keys = keys_of(ns, 1, layout, seed=41)
    data = payloads(layout, 1, seed=41)
    cases = [
        lambda: client.put(ns, keys, data, token_counts=[-1]),
        lambda: client.put(ns, keys, data, token_counts=[2 ** 32]),
        lambda: client.pin(ns, keys, ttl_seconds=-1),
        lambda: client.clear(-1),
        lambda: client.release_lease(ns, -5),
        lambda: client.lookup(-1, keys),
        lambda: client.lookup(ns, keys, lease_seconds=None),
        lambda: client.lookup(ns, keys, lease_seconds=1.5),
        lambda: client.lookup(ns, keys, lease_seconds=True),
        lambda: client.lookup(ns, keys, lease_seconds=2 ** 40),
        lambda: kvtier.Layout(model_id=None, dtype="bfloat16", num_layers=2, num_kv_heads=8,
                              head_dim=128, tokens_per_chunk=16),
        lambda: kvtier.Layout(model_id="m", dtype="bfloat16", num_layers=True,
                              num_kv_heads=8, head_dim=128, tokens_per_chunk=16),
        lambda: kvtier.Client(client.target, rpc_deadline=-1),
        lambda: kvtier.Client(client.target, rpc_deadline=float("nan")),
        lambda: client.put(ns, keys, data, token_counts=["a"]),
        lambda: client.put(ns, keys, data, chain_start="a"),
        lambda: client.put(ns, keys, (d for d in data)),
        lambda: client.put(ns, None, data),
        lambda: client.get_into(ns, None, [bytearray(layout.chunk_bytes)]),
        lambda: client.hint("x", [(ns,)]),
        lambda: client.hint("x", [("a", keys)]),
        lambda: client.prefill(-1, keys),
        lambda: client.prefill(ns, keys, compute_estimate=("a", 1)),
        lambda: client.prefill(ns, keys, max_bytes_per_second=-1),
        lambda: client.prefill(ns, keys, max_frame_bytes=2 ** 40),
    ]
    for i, case in enumerate(cases):
        with pytest.raises(kvtier.InvalidArgumentError):
            case()
    with client.prefill(ns, keys) as session:
        for bad in (-1, "a", 1.5):
            with pytest.raises(kvtier.InvalidArgumentError):
                session.should_compute(bad)
            with pytest.raises(kvtier.InvalidArgumentError):
                session.report_computed(bad)
    # The arguments that are right still work, whole floats and inf deadlines included.
    assert client.put(ns, keys, data).stored == 1
    assert client.lookup(ns, keys, lease_seconds=30.0).prefix_hits == 1
    kvtier.Client(client.target, rpc_deadline=float("inf")).close()
    # An error a callback raises inside a call is the callback's, not a bad argument.
    out = [bytearray(layout.chunk_bytes)]

    def on_layer(layer):
        raise TypeError("the caller's own bug")
    with pytest.raises(TypeError, match="the caller's own bug"):
        client.get_into(ns, keys, out, order="layer", on_layer=on_layer)


def _in_forked_child(fn):
    """Runs fn() in a child made with fork and returns what it returned or raised, as text."""
    import multiprocessing
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()

    def child():
        try:
            q.put("returned " + repr(fn()))
        except BaseException as e:  # noqa: B902 - reported to the parent
            q.put(f"{type(e).__name__}: {e}")
    p = ctx.Process(target=child)
    p.start()
    try:
        return q.get(timeout=60)
    finally:
        p.join(60)
        if p.is_alive():  # It hung: not left behind for the interpreter's exit to wait on.
            p.kill()
            p.join()


def test_a_forked_child_is_refused_and_the_parent_keeps_its_connection(client, ns, layout):
    """gRPC does not survive fork. A child forked after this process used kvtier once hung
    past every deadline with a new client, and sent its calls down the parent's
    connection (gRPC's global subchannel pool), which broke the parent's for good. The
    child now gets FailedPreconditionError saying so, and the parent goes on."""
    keys = keys_of(ns, 2, layout, seed=43)
    data = payloads(layout, 2, seed=43)
    assert client.put(ns, keys, data).stored == 2
    inherited = _in_forked_child(lambda: client.lookup(ns, keys).prefix_hits)
    assert inherited.startswith("FailedPreconditionError") and "fork" in inherited, inherited
    target = client.target  # Read here: the child may not use the parent's client.
    fresh = _in_forked_child(lambda: kvtier.Client(target).lookup(ns, keys).prefix_hits)
    assert fresh.startswith("FailedPreconditionError") and "fork" in fresh, fresh
    # A property that calls the daemon (data_path's DataPlane RPC) once hung the child:
    # the check ran only for native methods, after the attribute was read.
    with kvtier.Client(client.target) as unused:  # The data path not yet decided.
        prop = _in_forked_child(lambda: unused.data_path)
    assert prop.startswith("FailedPreconditionError") and "fork" in prop, prop
    for _ in range(3):
        out = [bytearray(layout.chunk_bytes) for _ in keys]
        assert client.get_into(ns, keys, out).prefix_found == 2
        assert [bytes(o) for o in out] == [bytes(d) for d in data]
    with kvtier.Client(client.target) as again:
        assert again.lookup(ns, keys).prefix_hits == 2


def _all_threads_stopped(pid):
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/stat") as f:
            stat = f.read()
        if stat[stat.rindex(")") + 2] != "T":
            return False
    return True


def stop_daemon(pid):
    """SIGSTOPs the daemon `pid` and polls (bounded) until every thread of it is stopped."""
    import signal
    import time
    os.kill(pid, signal.SIGSTOP)
    for _ in range(6000):
        if _all_threads_stopped(pid):
            return
        time.sleep(0.01)  # Polls a condition.
    pytest.fail(f"daemon {pid} did not stop")


async def until_in_flight(ac, task):
    """Polls (bounded) until a transfer of the kvtier.aio client `ac` is in flight: its
    native call waits on an RPC its canceller would end (Canceller.watching), not merely
    queued for the executor. Fails if `task` ends first."""
    import asyncio
    for _ in range(6000):
        if any(canceller.watching for canceller in list(ac._transfers)):
            return
        assert not task.done(), f"the transfer ended before it was seen in flight: {task}"
        await asyncio.sleep(0.01)  # Polls a condition.
    pytest.fail("no transfer of the client was seen in flight")


def test_cancel_and_close_end_loads_waiting_on_a_stopped_daemon(tmp_path, layout):
    """LoadHandle.cancel(), Client.close() and cancelling an aio task end a load that
    waits on a daemon that does not answer (stopped here) at once, with CancelledError;
    they once waited for the deadline (or forever without one)."""
    import signal
    import time
    from kvtier.testing import Daemon
    import kvtier.aio
    d = Daemon(str(tmp_path), args=["--ram-capacity=64MiB", "--write-mode=ram-only"])
    try:
        c = kvtier.Client(d.target, connect_timeout=30, rpc_deadline=0)  # No deadline.
        ns = c.register_layout(layout).namespace_id
        keys = keys_of(ns, 2, layout, seed=47)
        c.put(ns, keys, payloads(layout, 2, seed=47))
        out = [bytearray(layout.chunk_bytes) for _ in keys]
        assert c.get_into(ns, keys, out).prefix_found == 2
        # Connected before the daemon stops: a client that still had to connect would see
        # its get end by itself (the HTTP/2 handshake times out after 20 s), which would
        # hide a cancel that did nothing.
        connected = kvtier.aio.Client(d.target, rpc_deadline=0)
        assert connected.sync.lookup(ns, keys).prefix_hits == 2
        os.kill(d.proc.pid, signal.SIGSTOP)
        for _ in range(2000):
            if _all_threads_stopped(d.proc.pid):
                break
            time.sleep(0.01)  # Polls a condition.
        try:
            h = c.start_get_into(ns, keys, out)
            h.cancel()
            with pytest.raises(kvtier.CancelledError):
                h.wait(120)
            h = c.start_get_into(ns, keys, [bytearray(layout.chunk_bytes) for _ in keys])
            c.close()
            with pytest.raises(kvtier.CancelledError):
                h.wait(120)

            async def cancelled_task():
                import asyncio
                async with connected as ac:
                    task = asyncio.ensure_future(
                        ac.get_into(ns, keys, [bytearray(layout.chunk_bytes) for _ in keys]))
                    await until_in_flight(ac, task)  # Waiting on the stopped daemon.
                    task.cancel()
                    # Not wait_for: it would wait for a task that ignored the cancel for
                    # ever (this client's close() then ends the get).
                    done, _ = await asyncio.wait({task}, timeout=120)
                    assert task in done, "the cancelled task did not end"
                    with pytest.raises(asyncio.CancelledError):
                        task.result()

            async def closed_client():
                # close() cancels the transfers in flight and waits off the loop: it once
                # blocked the loop in the executor's shutdown until the call's deadline.
                ac = kvtier.aio.Client(d.target, rpc_deadline=0)
                task = asyncio.ensure_future(
                    ac.get_into(ns, keys, [bytearray(layout.chunk_bytes) for _ in keys]))
                await asyncio.sleep(0)
                while not ac._transfers:  # On the executor, waiting on the daemon.
                    await asyncio.sleep(0.01)  # Polls a condition.
                await asyncio.wait_for(ac.close(), 120)
                with pytest.raises(kvtier.CancelledError):
                    await task
            async def cancelled_get():
                # get (new bytes objects) is cancellable too: it once ran on with no
                # canceller, holding its executor thread until the deadline (none here),
                # and close() then waited on it for ever.
                import asyncio
                ac = kvtier.aio.Client(d.target, rpc_deadline=0)
                task = asyncio.ensure_future(ac.get(ns, keys))
                for _ in range(6000):  # On the executor, waiting on the daemon.
                    if ac._transfers:
                        break
                    await asyncio.sleep(0.01)  # Polls a condition.
                assert ac._transfers, "get runs without a canceller"
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await asyncio.wait_for(task, 120)
                await asyncio.wait_for(ac.close(), 120)

            import asyncio
            asyncio.run(cancelled_task())
            asyncio.run(closed_client())
            asyncio.run(cancelled_get())
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)
        again = [bytearray(layout.chunk_bytes) for _ in keys]
        assert c.get_into(ns, keys, again).prefix_found == 2
        assert [bytes(a) for a in again] == [bytes(p) for p in payloads(layout, 2, seed=47)]
    finally:
        d.close()


# Syscalls a thread waits on the region socket in (poll, ppoll, recvfrom, recvmsg).
_SOCKET_WAITS = {"x86_64": {"7", "271", "45", "47"}, "aarch64": {"73", "207", "212"}}


def _frees_waiting_on_the_daemon(daemon, held):
    """Stops `daemon`, drops the last reference in `held` on a thread of its own, and
    returns whether this thread got to run and saw that one waiting on the region socket
    (it could not have, had the freeing held the GIL). Resumes the daemon after."""
    import platform
    import signal
    import threading
    waits = _SOCKET_WAITS.get(platform.machine())
    if waits is None:
        pytest.skip(f"syscall numbers unknown for {platform.machine()}")
    # Every daemon thread stopped before the freeing starts: a SIGSTOP still on its way
    # let the removals be answered, and the test failed now and then.
    stop_daemon(daemon.proc.pid)
    tid, started = [], threading.Event()

    def free():
        tid.append(threading.get_native_id())
        started.set()
        held.clear()  # The last reference: its region removals wait on the daemon.

    t = threading.Thread(target=free)
    saw_waiting = False
    try:
        t.start()
        started.wait()
        while t.is_alive() and not saw_waiting:
            try:
                with open(f"/proc/self/task/{tid[0]}/syscall") as f:
                    saw_waiting = f.read().split()[0] in waits
            except FileNotFoundError:
                break  # The thread ended.
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    t.join(120)
    assert not t.is_alive()
    return saw_waiting


def test_freeing_a_shared_buffer_waits_on_the_daemon_without_the_gil(tmp_path):
    """A shared buffer's destructor unregisters its region: a round trip to the daemon,
    which waits as long as the daemon takes (up to the region socket's timeout for a
    stopped one). It once waited holding the GIL, stalling every Python thread. Here a
    thread frees a buffer while the daemon is stopped, and this thread must get to run
    and see it waiting on the socket."""
    d = Daemon(str(tmp_path), args=["--ram-capacity=64MiB", "--write-mode=ram-only"])
    try:
        c = kvtier.Client(d.target, connect_timeout=30)
        held = [c.shared_buffer(1 << 20)]
        assert _frees_waiting_on_the_daemon(d, held), \
            "the buffer's region was removed holding the GIL"
        c.close()
    finally:
        d.close()


def test_freeing_a_client_waits_on_the_daemon_without_the_gil(tmp_path):
    """The same for the client: freed, it unregisters its staging buffers (a round trip
    each). It once did so holding the GIL."""
    import gc
    d = Daemon(str(tmp_path), args=["--ram-capacity=64MiB", "--write-mode=ram-only"])
    try:
        c = kvtier.Client(d.target, connect_timeout=30)
        layout = small_layout()
        ns = c.register_layout(layout).namespace_id
        keys = keys_of(ns, 1, layout, seed=53)
        data = [p.tobytes() for p in payloads(layout, 1, seed=53)]
        assert c.put(ns, keys, data).stored == 1
        assert c.get(ns, keys) == data  # Into Python's memory: through a staging buffer.
        assert c.stats().regions >= 1
        held = [c]
        del c
        gc.collect()
        assert _frees_waiting_on_the_daemon(d, held), "the client was torn down holding the GIL"
    finally:
        d.close()


def test_values_a_newer_daemon_adds_are_kept_not_fatal():
    """The proto promises tiers and Done reasons may be added: an unknown one is kept
    (present, with its number), not a ValueError that fails a call whose data landed."""
    from kvtier.prefill import _reason_name
    t = kvtier.Tier(9)
    assert int(t) == 9 and t.name == "TIER_9" and t != kvtier.Tier.ABSENT
    assert kvtier.Tier(2) is kvtier.Tier.RAM
    with pytest.raises(ValueError):
        kvtier.Tier(-1)
    assert _reason_name(1) == "MET"
    assert _reason_name(7) == "REVOKED"
    assert _reason_name(99) == "REASON_99"
