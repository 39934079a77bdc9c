"""KvTierConnector's contract at its edges, against a real kvtierd: loads that fail to
start or fail mid-way, requests ended or re-asked while their load runs, several save
passes per request, and a daemon that restarts empty.

Loads that must stay in flight, or fail on cue, use HeldLoad: a LoadHandle stand-in with
no thread, whose bytes land only when the test calls land() (CacheLib's MockJobScheduler
idea: the test runs the pending job by hand). Everything else is the real client.
"""

import os
import shutil

import pytest
import torch

import kvtier
from conftest import SMALL, random_tokens, small_model
from kvtier_worker.connector import KvTierConnector
from kvtier_worker.worker import Worker, compute_local

C = 16


def layout(model_id):
    return kvtier.Layout(model_id=model_id, dtype="float32", num_layers=SMALL.num_layers,
                         num_kv_heads=SMALL.num_kv_heads, head_dim=SMALL.head_dim,
                         tokens_per_chunk=C)


def cache_prompt(client, conn, model, tokens):
    """Stores the full chunks of ``tokens``, computed in one pass; returns their keys."""
    _, kv = model.prefill(tokens)
    keys = kvtier.chunk_keys(conn.ns, tokens.numpy(), C)
    client.put(conn.ns, keys, list(conn.chunks.pack(kv)))
    return keys


def present(client, ns, keys):
    return [t != kvtier.Tier.ABSENT for t in client.lookup(ns, keys).tiers]


class HeldLoad:
    """A load whose Get has not landed: land() writes its bytes into ``out`` unless the
    load ended first (cancelled and joined). ``error`` makes it a load that failed."""

    def __init__(self, out, error=None):
        self.out = out
        self.error = error
        self.finished = error is not None
        self.cancelled = False

    def land(self):
        if not self.finished:
            self.out.fill_(1.0)
            self.finished = True

    def done(self):
        return self.finished

    def cancel(self):
        self.cancelled = True

    def _end(self):
        if not self.finished:
            if not self.cancelled:
                raise AssertionError("would block: the load has not landed")
            # A cancelled Get stops; joining it sees CancelledError.
            self.finished, self.error = True, kvtier.CancelledError("cancelled")
        if self.error is not None:
            raise self.error

    def wait_layer(self, layer, timeout=None):
        self._end()

    def wait(self, timeout=None):
        self._end()
        n = self.out.shape[0]
        return kvtier.GetResult([True] * n, [kvtier.Tier.RAM] * n, [C] * n, 0)


class ScriptedClient:
    """The real client, except that start_get_into calls ``start`` (the test's fault)."""

    def __init__(self, real, start):
        self._real = real
        self._start = start

    def __getattr__(self, name):
        return getattr(self._real, name)

    def start_get_into(self, ns, keys, out, **kwargs):
        return self._start(out)


def test_a_load_that_cannot_start_is_a_failed_load_and_stores_nothing(client):
    # start_load_kv once swallowed a synchronous start_get_into error: wait_for_layer_load
    # returned None ("nothing loaded"), the forward ran without the prefix, and the commit
    # rule (checked only for a load with a handle) let its KV be stored under the keys.
    model = small_model()
    tokens = random_tokens(136, 80)               # 6 cached chunks, then 2 new ones.
    lay = layout("start-fails")

    def refuse(out):
        raise kvtier.UnavailableError("injected: the Get could not start")

    conn = KvTierConnector(ScriptedClient(client, refuse), lay)
    cache_prompt(client, conn, model, tokens[:96])
    keys = kvtier.chunk_keys(conn.ns, tokens.numpy(), C)
    leases = client.stats().leases
    assert conn.get_num_new_matched_tokens("x", tokens) == (96, True)
    conn.update_state_after_alloc("x")
    conn.start_load_kv("x")
    assert client.stats().leases == leases        # No Get ran to end it: released.
    with pytest.raises(kvtier.UnavailableError, match="injected"):
        conn.wait_for_layer_load("x", 0)
    # An engine that computes on regardless: KV of [96, 136) is not stored under keys 6, 7.
    g = torch.Generator().manual_seed(1)
    for l in range(SMALL.num_layers):
        k, v = (torch.randn(SMALL.num_kv_heads, 40, SMALL.head_dim, generator=g)
                for _ in range(2))
        conn.save_kv_layer("x", l, k, v, 96)
    assert conn.wait_for_save("x") is None
    assert present(client, conn.ns, keys[6:8]) == [False, False]
    assert conn.finish_load("x") == 0
    assert conn.get_failed_loads() == {"x": 0}
    assert conn.get_finished(["x"])[1] == {"x"}
    # A buffer the host path cannot fill is refused before any load starts.
    conn.get_num_new_matched_tokens("y", tokens)
    with pytest.raises(ValueError, match="on meta"):
        conn.update_state_after_alloc("y", torch.empty((6,) + conn.chunks.chunk_shape,
                                                       device="meta"))
    conn.get_finished(["y"])
    # The worker serves such a request by computing it, and stores that.
    w = Worker(model, client, C, model_id="start-fails")
    assert w.serve(tokens[:96], "none").stored_chunks == 6
    w.connector.client = ScriptedClient(client, refuse)
    r = w.serve(tokens, "layer")
    assert r.fallback.startswith("load failed") and r.reused_chunks == 0
    assert torch.equal(r.logits, compute_local(model, tokens, 0, C)[0])
    assert r.stored_chunks == 2


def test_each_forward_pass_saves_its_own_chunks(client):
    # A second save_kv_layer pass on one request (chunked prefill) once reused the first
    # pass's buffer and keys: its chunks were never stored, and its KV was Put again under
    # the first pass's keys (stored, when those had been evicted in between).
    model = small_model()
    conn = KvTierConnector(client, layout("passes"))
    t = random_tokens(70, 81)
    keys = kvtier.chunk_keys(conn.ns, t.numpy(), C)
    conn.get_num_new_matched_tokens("r", t, lookup=False)

    def saver(req, start):
        return lambda l, k, v: conn.save_kv_layer(req, l, k, v, start)

    _, kv1 = model.prefill(t[:32], 0, None, on_layer_kv=saver("r", 0))
    assert conn.wait_for_save("r").stored == 2
    client.delete(conn.ns, keys[:2])              # Evicted before the second pass.
    _, kv2 = model.prefill(t[32:64], 32, kv1, on_layer_kv=saver("r", 32))
    assert conn.wait_for_save("r").stored == 2
    assert present(client, conn.ns, keys[:4]) == [False, False, True, True]
    got = conn.chunks.alloc(2)
    assert client.get_into(conn.ns, keys[2:4], got).prefix_found == 2
    assert torch.equal(got, conn.chunks.pack(kv2))
    # Two passes with no wait_for_save between them: the second joins the first's Put,
    # and one wait_for_save reports both.
    u = random_tokens(70, 82)
    ukeys = kvtier.chunk_keys(conn.ns, u.numpy(), C)
    conn.get_num_new_matched_tokens("s", u, lookup=False)
    _, ukv1 = model.prefill(u[:32], 0, None, on_layer_kv=saver("s", 0))
    _, ukv2 = model.prefill(u[32:64], 32, ukv1, on_layer_kv=saver("s", 32))
    assert conn.wait_for_save("s").stored == 4
    assert conn.wait_for_save("s") is None         # Each pass is reported once.
    got = conn.chunks.alloc(4)
    assert client.get_into(conn.ns, ukeys[:4], got).prefix_found == 4
    assert torch.equal(got, conn.chunks.pack([(torch.cat([a[0], b[0]], 1),
                                               torch.cat([a[1], b[1]], 1))
                                              for a, b in zip(ukv1, ukv2)]))
    conn.get_finished(["r", "s"])


def test_a_chunk_straddling_two_passes_is_stored_by_the_later_one(client):
    # Chunked prefill over [0, 40) then [40, 70): chunk 2 (tokens 32-47) has KV in both
    # passes. Each pass once stored only the chunks wholly among its own new tokens, so
    # chunk 2 was never stored and every later lookup stopped at 2 chunks.
    model = small_model()
    conn = KvTierConnector(client, layout("straddle"))
    t = random_tokens(70, 83)
    keys = kvtier.chunk_keys(conn.ns, t.numpy(), C)
    conn.get_num_new_matched_tokens("r", t, lookup=False)
    req = conn._req("r")

    def saver(start):
        return lambda l, k, v: conn.save_kv_layer("r", l, k, v, start)

    _, kv1 = model.prefill(t[:40], 0, None, on_layer_kv=saver(0))
    assert conn.wait_for_save("r").stored == 2
    _, kv2 = model.prefill(t[40:70], 40, kv1, on_layer_kv=saver(40))
    assert conn.wait_for_save("r").stored == 2    # Chunks 2 and 3.
    assert client.lookup(conn.ns, keys[:4]).prefix_hits == 4
    whole = [(torch.cat([a[0], b[0]], 1), torch.cat([a[1], b[1]], 1))
             for a, b in zip(kv1, kv2)]
    got = conn.chunks.alloc(4)
    assert client.get_into(conn.ns, keys[:4], got).prefix_found == 4
    assert torch.equal(got[2], conn.chunks.pack([(k[:, 32:48], v[:, 32:48])
                                                 for k, v in whole])[0])
    assert torch.equal(got, conn.chunks.pack(whole))
    # The second pass's own tail (tokens 64-69) is no full chunk's: nothing is kept.
    assert req.save.tail == {}
    # A pass that ends mid-chunk keeps its tail until the request is forgotten; the next
    # pass, if it does not start where that one ended, gets none of it.
    reqs = {}
    for r, seed in (("s", 84), ("q", 85)):
        u = random_tokens(70, seed)
        conn.get_num_new_matched_tokens(r, u, lookup=False)
        reqs[r] = conn._req(r)
        model.prefill(u[:40], 0, None,
                      on_layer_kv=lambda l, k, v, r=r: conn.save_kv_layer(r, l, k, v, 0))
        assert conn.wait_for_save(r).stored == 2
        assert sorted(reqs[r].save.tail) == list(range(SMALL.num_layers))
        assert reqs[r].save.tail[0][0].shape[1] == 8  # Tokens 32-39.
    g = torch.Generator().manual_seed(2)
    for l in range(SMALL.num_layers):            # Tokens [48, 64): chunk 3 only.
        k, v = (torch.randn(SMALL.num_kv_heads, 16, SMALL.head_dim, generator=g)
                for _ in range(2))
        conn.save_kv_layer("q", l, k, v, 48)
    assert conn.wait_for_save("q").stored == 1
    qkeys = kvtier.chunk_keys(conn.ns, reqs["q"].tokens.numpy(), C)
    assert present(client, conn.ns, qkeys[:4]) == [True, True, False, True]
    conn.get_finished(["r", "s", "q"])
    assert reqs["s"].save.tail == {}


def test_ending_a_request_stops_its_load_before_returning(client):
    # get_finished([req]) once forgot a request whose load was still running: the Get
    # went on and overwrote the buffer after the engine had given it to another request.
    model = small_model()
    loads = []

    def held(out):
        loads.append(HeldLoad(out))
        return loads[-1]

    conn = KvTierConnector(ScriptedClient(client, held), layout("abort"))
    prompt = random_tokens(100, 83)
    cache_prompt(client, conn, model, prompt)
    conn.get_num_new_matched_tokens("a", prompt)
    buf = conn.update_state_after_alloc("a")
    conn.start_load_kv("a")
    conn.get_finished(["a"])                       # The engine aborts "a".
    assert loads[0].cancelled and loads[0].done()  # Cancelled and joined.
    buf.fill_(7.0)                                 # Its blocks now hold another request's KV.
    loads[0].land()                                # The Get's bytes would arrive now.
    assert bool((buf == 7.0).all())
    with pytest.raises(KeyError, match="unknown"):
        conn.finish_load("a")


def test_asking_again_for_a_request_holds_one_lease(client):
    # vLLM asks get_num_new_matched_tokens again each step while a request waits; each ask
    # once took a new Lookup lease and dropped the previous one unreleased (held until
    # expiry, using up the daemon's lease bounds).
    model = small_model()
    conn = KvTierConnector(client, layout("reask"))
    prompt = random_tokens(100, 84)
    cache_prompt(client, conn, model, prompt)
    base = client.stats().leases
    for _ in range(5):
        assert conn.get_num_new_matched_tokens("r", prompt) == (96, True)
        assert client.stats().leases == base + 1
    conn.update_state_after_alloc("r")
    conn.start_load_kv("r")
    assert conn.finish_load("r") == 6
    conn.get_finished(["r"])
    assert client.stats().leases == base
    # Asked again after its load (a preempted request rescheduled): a fresh match.
    assert conn.get_num_new_matched_tokens("r", prompt) == (96, True)
    conn.get_finished(["r"])
    assert client.stats().leases == base


def test_a_layer_load_that_fails_is_reported_finished_once(client):
    # A load that failed inside wait_for_layer_load was never in finished_recving:
    # finish_load skipped its bookkeeping once load_error was set.
    model = small_model()

    def failed(out):
        return HeldLoad(out, error=kvtier.DataLossError("injected: chunk 2 failed its CRC"))

    conn = KvTierConnector(ScriptedClient(client, failed), layout("layer-fails"))
    prompt = random_tokens(100, 85)
    cache_prompt(client, conn, model, prompt)
    conn.get_num_new_matched_tokens("r", prompt)
    conn.update_state_after_alloc("r")
    conn.start_load_kv("r")
    with pytest.raises(kvtier.DataLossError):
        conn.wait_for_layer_load("r", 0)
    assert conn.finish_load("r") == 0
    assert conn.get_failed_loads() == {"r": 0}
    assert conn.get_finished()[1] == {"r"}
    assert conn.finish_load("r") == 0
    assert conn.get_finished(["r"])[1] == set()    # Reported once.


def test_a_worker_builds_and_serves_while_the_daemon_is_down(tmp_path):
    # The layout was registered in the constructor only: with the daemon down, Worker()
    # raised UnavailableError instead of serving without the cache.
    from kvtier.testing import Daemon
    d = Daemon(str(tmp_path), args=["--ram-capacity=64MiB", "--write-mode=ram-only"])
    d.close()                                       # Its port: nothing listens there now.
    with kvtier.Client(d.target, rpc_deadline=10) as client:
        w = Worker(small_model(), client, C, model_id="down")
        t = random_tokens(50, 86)
        r = w.serve(t, "layer")
        assert r.fallback.startswith("lookup failed") and r.put_error
        assert torch.equal(r.logits, compute_local(w.model, t, 0, C)[0])


def test_the_worker_registers_again_when_the_daemon_restarts_empty(tmp_path):
    # After a restart with an empty data directory every Lookup and Put got NOT_FOUND
    # ("namespace_id is not registered") forever: the layout was registered once.
    from kvtier.testing import Daemon
    data = str(tmp_path / "data")
    d = Daemon(data, args=["--ram-capacity=64MiB", "--write-mode=ram-only"])
    try:
        d.args.append(f"--listen=127.0.0.1:{d.port}")  # Restarts keep the port.
        with kvtier.Client(d.target, rpc_deadline=10) as client:
            w = Worker(small_model(), client, C, model_id="restart")
            t = random_tokens(50, 87)
            assert w.serve(t, "none").stored_chunks == 3
            d.kill()
            shutil.rmtree(data)
            os.makedirs(data)
            d.start()                               # Same port, nothing registered.
            r = w.serve(t, "none")
            assert r.put_error == "" and r.stored_chunks == 3
            r = w.serve(t, "layer")
            assert r.fallback == "" and r.reused_chunks == 3
    finally:
        d.close()


def test_a_load_the_daemon_refuses_releases_its_lease(tmp_path):
    # start_load_kv handed the Lookup lease to the Get and forgot it; a Get refused at
    # admission (here: past max_streams) ends no lease, so the lease and its chunks
    # stayed held until expiry, whether finish_load or get_finished ended the request.
    import threading
    from kvtier.testing import Daemon
    model = small_model()
    # The daemon's one stream is taken by a Get whose reader stalls in on_layer: on the
    # gRPC stream (no shared memory), 64 MiB cannot all be sent ahead of the reader.
    big = kvtier.Layout(model_id="refused-holder", dtype="float32", num_layers=4,
                        num_kv_heads=8, head_dim=128, tokens_per_chunk=256)  # 8 MiB chunks.
    with Daemon(str(tmp_path), args=["--ram-capacity=256MiB", "--write-mode=ram-only",
                                     "--max-streams=1", "--shm-socket=off"]) as d, \
            kvtier.Client(d.target, rpc_deadline=60) as client, \
            kvtier.Client(d.target, rpc_deadline=60, receive_window_bytes=1 << 20) as other:
        conn = KvTierConnector(client, layout("refused"))
        prompt = random_tokens(100, 88)
        cache_prompt(client, conn, model, prompt)
        ns = other.register_layout(big).namespace_id
        held = [bytes([i]) * 16 for i in range(8)]
        other.put(ns, held, [bytearray(big.chunk_bytes)] * 8)
        streaming, release = threading.Event(), threading.Event()

        def stall(layer):
            streaming.set()
            release.wait()

        holder = threading.Thread(target=other.get_into, args=(
            ns, held, bytearray(8 * big.chunk_bytes)), kwargs=dict(order="layer",
                                                                   on_layer=stall))
        holder.start()
        try:
            assert streaming.wait(60)
            base = client.stats().leases
            for req in ("r", "s"):                      # s: ended without finish_load.
                assert conn.get_num_new_matched_tokens(req, prompt) == (96, True)
                assert client.stats().leases == base + 1
                conn.start_load_kv(req)
                if req == "r":
                    assert conn.finish_load("r") == 0
                    assert isinstance(conn._req("r").load_error, kvtier.ResourceExhaustedError)
                    assert conn.get_failed_loads() == {"r": 0}
                    assert client.stats().leases == base
                conn.get_finished([req])
                assert client.stats().leases == base
        finally:
            release.set()
            holder.join()
