"""The worker against a real kvtierd: exactness of reuse, layer-wise loads, Cake, context
overflow, the connector seam, failures and bad input.

Tolerance against a full prefill (no reuse). Serving a request from reused chunks runs
the same operations as a full prefill; only the shapes of some matmuls differ (the
suffix's rows alone, keys split into prefix and suffix), so a backend may block and sum
differently. Each such dot product of length n changes by at most gamma_n * sum|x_i y_i|
(gamma_n = n*u/(1 - n*u), Higham's bound) and RMSNorm keeps each layer's input at unit
scale, so after L layers the logits move by roughly L * gamma_n * |logit| at most, with
n the longest reduction (intermediate size, or the context length). We allow
TOL = 2 * L * gamma_n * max|logits| with u = 2^-24 for float32. bfloat16 matmuls
accumulate in float32 and round each result to bfloat16 (u = 2^-8): a different sum can
flip one rounding per element by one ulp (2u relative), giving 2 * L * 2u * max|logits|
(u the bfloat16 unit roundoff; the float32 accumulation error is far smaller). Measured
here (single-threaded MKL/oneDNN, these shapes) the difference is 0 for both: the bound
is what a different backend or thread count may use.
"""

import pytest
import torch

import kvtier  # noqa: F401  (skips below when missing come from the daemon fixture)
from conftest import SMALL, random_tokens, small_model
from kvtier_worker.connector import KvTierConnector
from kvtier_worker.kv_layout import ChunkLayout
from kvtier_worker.worker import Worker, compute_local

C = 16


def tolerance(model, logits):
    L = model.cfg.num_layers
    scale = float(logits.float().abs().max())
    if model.cfg.dtype == torch.float32:
        u = 2.0 ** -24
        n = max(model.cfg.intermediate, model.cfg.hidden, 512)
        return 2 * L * (n * u / (1 - n * u)) * scale
    return 2 * L * 2 * 2.0 ** -8 * scale


def kv_equal(a, b):
    return all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))


def make_worker(client, model_id, **model_kw):
    return Worker(small_model(**model_kw), client, C, model_id=model_id)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", ["chunk", "layer"])
def test_reuse_is_bitwise_local_compute_and_close_to_full_prefill(client, dtype, mode):
    w = make_worker(client, f"exact-{dtype}-{mode}", dtype=dtype)
    prompt = random_tokens(100, 10)
    cold = w.serve(prompt, "none")
    assert cold.reused_chunks == 0 and cold.stored_chunks == 6
    longer = torch.cat([prompt, random_tokens(45, 11)])
    r = w.serve(longer, mode)
    assert r.fallback == "" and r.reused_chunks == 6 and r.computed_from == 96
    assert r.stored_chunks == 3  # Chunks 6, 7, 8 of 145 tokens.
    ref_logits, ref_kv = compute_local(w.model, longer, 6, C)
    assert torch.equal(r.logits, ref_logits)
    assert kv_equal(r.kv, ref_kv)
    full_logits, full_kv = w.model.prefill(longer)
    diff = float((r.logits.float() - full_logits[96:].float()).abs().max())
    assert diff <= tolerance(w.model, full_logits), diff
    # A third request reuses what the second stored, through all 9 chunks.
    again = w.serve(torch.cat([longer, random_tokens(5, 12)]), mode)
    assert again.reused_chunks == 9


def test_layer_major_and_per_layer_loads_give_chunk_major_bytes(client):
    w = make_worker(client, "layer-bytes")
    w.serve(random_tokens(130, 20), "none")
    keys = kvtier.chunk_keys(w.ns, random_tokens(130, 20).numpy(), C)
    lay = w.chunks
    chunk_major = lay.alloc(len(keys))
    assert client.get_into(w.ns, keys, chunk_major).prefix_found == 8
    # One Get per layer range, each into that layer of every chunk.
    ranges = lay.alloc(len(keys))
    for l in range(lay.num_layers):
        assert client.get_into(w.ns, keys, [ranges[i, l] for i in range(len(keys))],
                               layers=(l, l + 1)).found == [True] * 8
    assert torch.equal(ranges, chunk_major)
    # One layer-major Get: every layer of every chunk where the layout puts it.
    streamed = lay.alloc(len(keys))
    landed = []
    client.get_into(w.ns, keys, streamed, order="layer", on_layer=landed.append)
    assert landed == list(range(lay.num_layers))
    assert torch.equal(streamed, chunk_major)


@pytest.mark.parametrize("cap", [0, 2_000_000, 1])
def test_cake_equals_computing_everything(client, cap):
    w = make_worker(client, f"cake-{cap}")
    tokens = random_tokens(200, 30)  # 12 full chunks; 11 usable, 8 cached.
    # Cache the first 8 chunks exactly as Cake computes them (one chunk at a time), so a
    # streamed chunk and a computed one are the same bytes whatever the split.
    _, kv = compute_local(w.model, tokens[:129], 8, C, chunkwise_prefix=True)
    keys = kvtier.chunk_keys(w.ns, tokens.numpy(), C)
    client.put(w.ns, keys[:8], list(w.chunks.pack(kv, 8)))
    r = w.serve_cake(tokens, max_bytes_per_second=cap)
    assert r.fallback == ""
    p = r.prefill
    assert p.cached_prefix == 8 and r.computed_from == 128
    assert p.first_streamed + p.chunks_streamed == 8
    ref_logits, ref_kv = compute_local(w.model, tokens, 8, C, chunkwise_prefix=True)
    assert torch.equal(r.logits, ref_logits)
    assert kv_equal(r.kv, ref_kv)
    assert r.stored_chunks == 4  # Chunks 8..11.
    if cap == 1:  # 1 byte/s: the worker computes (almost) every cached chunk.
        assert p.chunks_streamed <= 1  # At most a first burst of the rate limiter.
    if len(r.chunk_times) >= 2:
        a, b = w.compute_estimate()
        assert a >= 0 and b >= 0
    # The fit itself: chunk i costs a + b*i.
    w._compute_fit = [(i, 0.01 + 0.002 * i) for i in range(10)]
    a, b = w.compute_estimate()
    assert abs(a - 0.01) < 1e-9 and abs(b - 0.002) < 1e-9


def test_context_overflow_reuses_newest_chunks_at_new_positions(client):
    window = 128
    w = make_worker(client, "overflow", key_position="pre_rope", max_position=window)
    turn1 = random_tokens(112, 40)
    w.serve(turn1, "none")                      # 7 chunks cached, pre-RoPE.
    convo = torch.cat([turn1, random_tokens(64, 41)])  # 176 tokens > window.
    r = w.serve_truncated(convo, window)
    drop = 3                                     # ceil((176 - 128) / 16)
    assert r.timings["dropped_chunks"] == drop
    assert r.reused_chunks == 4 and r.computed_from == 64   # Chunks 3..6 at positions 0..63.
    assert r.logits.shape == (176 - drop * C - 64, SMALL.vocab_size)
    assert torch.isfinite(r.logits).all()
    # Recomputing the truncated context from scratch: layer 0's pre-RoPE K and V depend on
    # the token alone, so the reused chunks match bitwise there, and rotated at the new
    # positions they equal the recomputation's rotated keys; deeper layers saw the dropped
    # tokens when they were cached (CachedAttention's approximation).
    sub = convo[drop * C:]
    ref_logits, ref_kv = w.model.prefill(sub)
    pos = torch.arange(64)
    assert torch.equal(r.kv[0][0][:, :64], ref_kv[0][0][:, :64])
    assert torch.equal(w.model.rope.apply(r.kv[0][0][:, :64], pos),
                       w.model.rope.apply(ref_kv[0][0][:, :64], pos))
    assert not torch.equal(r.kv[1][0][:, :64], ref_kv[1][0][:, :64])
    assert r.stored_chunks == 4                  # Chunks 7..10, under truncated_keys.
    keys = kvtier.chunk_keys(w.ns, convo.numpy(), C)
    assert client.lookup(w.ns, keys[7:11]).prefix_hits == 0  # Not the conversation's keys.
    # The same conversation again (the same chunks dropped) reuses the conversation's
    # chunks 3..6, then the chunks 7..9 the first request computed: exactly its bytes.
    again = w.serve_truncated(convo, window)
    assert again.reused_chunks == 7 and again.computed_from == 112 and again.fallback == ""
    ref_logits, _ = w.model.prefill(sub[112:], 112, [(k[:, :112], v[:, :112]) for k, v in r.kv])
    assert torch.equal(again.logits, ref_logits)
    # A later turn drops chunks 3, 4 as well: what was computed without 0..2 only is not
    # its context, so it reuses the conversation's chunks 5, 6 and computes the rest.
    r2 = w.serve_truncated(torch.cat([convo, random_tokens(20, 42)]), window)
    assert r2.timings["dropped_chunks"] == 5 and r2.reused_chunks == 2
    post = make_worker(client, "overflow-post", max_position=window)
    with pytest.raises(ValueError, match="pre-RoPE"):
        post.serve_truncated(convo, window)


def test_truncated_kv_is_never_reused_by_a_full_context_request(client):
    # serve_truncated once stored the KV it computed without the dropped chunks under the
    # conversation's own keys; a later ordinary request for a prefix of the conversation
    # reused it, and its logits moved by up to 1.4 from recomputing.
    window = 128
    w = make_worker(client, "overflow-exact", key_position="pre_rope", max_position=window)
    convo = random_tokens(130, 43)
    w.serve(convo[:20], "none")                   # Chunk 0, full context.
    tr = w.serve_truncated(convo, window)         # Drops chunk 0; computes chunks 1..7.
    assert tr.timings["dropped_chunks"] == 1 and tr.reused_chunks == 0
    assert tr.stored_chunks == 7
    # The same truncated request again reuses what the first computed, bitwise.
    again = w.serve_truncated(convo, window)
    assert again.reused_chunks == 7
    sub_kv = [(k[:, :112], v[:, :112]) for k, v in tr.kv]
    assert torch.equal(again.logits, w.model.prefill(convo[16 + 112:], 112, sub_kv)[0])
    prompt = convo[:120]                          # Fits the window: an ordinary request.
    r = w.serve(prompt, "layer")
    assert r.reused_chunks == 1                   # Chunk 0 only.
    ref_logits, ref_kv = compute_local(w.model, prompt, 1, C)
    assert torch.equal(r.logits, ref_logits) and kv_equal(r.kv, ref_kv)


def test_cake_compute_samples_are_bounded(client):
    # Worker._compute_fit once grew by one sample per Cake-computed chunk, forever, while
    # compute_estimate read only the last 256.
    w = Worker(small_model(num_layers=1), client, 2, model_id="cake-samples")
    tokens = random_tokens(302, 44)               # 150 usable chunks of 2 tokens.
    w.serve(tokens, "none")
    computed = 0
    for _ in range(2):                            # At 1 byte/s the worker computes them.
        r = w.serve_cake(tokens, put=False, max_bytes_per_second=1)
        computed += len(r.chunk_times)
    assert computed > 256
    assert len(w._compute_fit) == 256
    assert list(w._compute_fit)[-len(r.chunk_times):] == r.chunk_times
    assert w.compute_estimate() is not None


def test_connector_sequence_and_partial_load(client):
    model = small_model()
    lay = kvtier.Layout(model_id="connector", dtype="float32", num_layers=SMALL.num_layers,
                        num_kv_heads=SMALL.num_kv_heads, head_dim=SMALL.head_dim,
                        tokens_per_chunk=C)
    conn = KvTierConnector(client, lay)
    tokens = random_tokens(100, 50)
    _, kv = model.prefill(tokens)
    keys = kvtier.chunk_keys(conn.ns, tokens.numpy(), C)
    client.put(conn.ns, keys, list(conn.chunks.pack(kv)))
    leases = client.stats().leases
    matched, load_async = conn.get_num_new_matched_tokens("r1", tokens)
    assert (matched, load_async) == (96, True)
    assert conn.get_num_new_matched_tokens("r0", tokens[:96])[0] == 80  # >= 1 token left.
    assert client.stats().leases == leases + 2  # Each match is held until its load.
    client.delete(conn.ns, keys[3:4])   # Evicted between Lookup and Get.
    with pytest.raises(ValueError, match="5 chunks, the match is 6"):
        conn.update_state_after_alloc("r1", conn.chunks.alloc(5))
    conn.update_state_after_alloc("r1")
    conn.start_load_kv("r1", order="chunk")
    assert conn.finish_load("r1") == 3
    assert conn.get_failed_loads() == {"r1": 3}
    assert client.stats().leases == leases + 1  # r1's Get ended its lease.
    sending, recving = conn.get_finished(["r1", "r0"])
    assert recving == {"r1"}
    assert client.stats().leases == leases  # r0 never loaded: released when finished.
    with pytest.raises(KeyError, match="unknown"):
        conn.start_load_kv("r1")


def test_worker_recomputes_after_a_partial_load(client):
    w = make_worker(client, "partial")
    tokens = random_tokens(120, 60)
    w.serve(tokens, "none")
    keys = kvtier.chunk_keys(w.ns, tokens.numpy(), C)
    # Lookup sees 7 chunks; the delete lands between Lookup and Get. Done by wrapping
    # start_load_kv, as an eviction race would.
    orig = w.connector.start_load_kv

    def racing(req, order="layer"):
        client.delete(w.ns, keys[4:5])
        return orig(req, order)

    w.connector.start_load_kv = racing
    r = w.serve(tokens, "layer")
    assert r.fallback.startswith("partial load: 4 of 7") and r.reused_chunks == 4
    ref_logits, ref_kv = compute_local(w.model, tokens, 4, C)
    assert torch.equal(r.logits, ref_logits) and kv_equal(r.kv, ref_kv)
    assert r.stored_chunks == 1  # Chunk 4 again, from the recomputation.


def test_a_request_whose_serving_raises_is_retired(client):
    """A model error mid-request (or an interrupt) once left the request in the
    connector: its load thread running, its load buffer held for good, its lease held
    until expiry. The request is now retired however serving ends."""
    w = make_worker(client, "raises")
    tokens = random_tokens(80, 62)
    w.serve(tokens, "none")  # Stores the chunks: the next serve loads them.

    def broken(*args, **kwargs):
        raise RuntimeError("the model failed")

    w.model.prefill = broken
    for mode in ("layer", "chunk"):
        with pytest.raises(RuntimeError, match="the model failed"):
            w.serve(tokens, mode)
        assert w.connector._reqs == {}


def test_bad_input(client):
    w = make_worker(client, "bad")
    lay = w.layout
    keys = kvtier.chunk_keys(w.ns, random_tokens(32, 70).numpy(), C)
    good = w.chunks.alloc(2)
    with pytest.raises(kvtier.InvalidArgumentError, match="bytes"):
        client.put(w.ns, keys, [good[0], good[1][:, :1].contiguous()])
    with pytest.raises(kvtier.InvalidArgumentError, match="contiguous"):
        client.put(w.ns, keys, [good[0], good[1].transpose(0, 1)])
    with pytest.raises(kvtier.InvalidArgumentError, match="dtype"):
        client.put(w.ns, keys, [g.bfloat16() for g in good])
    with pytest.raises(kvtier.InvalidArgumentError, match="bytes"):
        client.get_into(w.ns, keys, w.chunks.alloc(1))
    with pytest.raises(ValueError, match="not contiguous"):
        w.chunks.pack(w.model.prefill(random_tokens(32, 70))[1], out=w.chunks.alloc(4)[::2])
    with pytest.raises(ValueError, match="mode"):
        w.serve(random_tokens(8, 71), "bogus")
    with pytest.raises(ValueError, match="non-empty"):
        w.serve(torch.zeros(0, dtype=torch.long))
    assert lay.chunk_bytes == w.chunks.chunk_bytes == ChunkLayout.from_kvtier(lay).chunk_bytes


@pytest.mark.parametrize("field,value", [("rope_theta", 500000.0), ("rms_eps", 1e-6),
                                         ("intermediate", 96), ("num_heads", 2)])
def test_models_that_differ_in_any_config_field_do_not_share_chunks(client, field, value):
    # The layout's model_revision once named only seed, hidden and vocab: a model with
    # another rope_theta (same model_id) reused the first model's KV and its logits
    # moved by up to 8.8 from its own.
    a = make_worker(client, "shared-id")
    b = make_worker(client, "shared-id", **{field: value})
    assert a.ns != b.ns
    seed = 900 + 10 * ["rope_theta", "rms_eps", "intermediate", "num_heads"].index(field)
    prompt = random_tokens(100, seed)
    assert a.serve(prompt, "none").stored_chunks == 6
    longer = torch.cat([prompt, random_tokens(20, seed + 1)])
    r = b.serve(longer, "layer")
    assert r.reused_chunks == 0
    ref_logits, _ = compute_local(b.model, longer, 0, C)
    assert torch.equal(r.logits, ref_logits)


def test_a_daemon_outage_degrades_to_computing(tmp_path):
    """The cache is a shortcut, not a dependency: with the daemon gone, every mode serves
    the request by computing it, says why (fallback, put_error), and raises nothing."""
    kvtier_mod = pytest.importorskip("kvtier")
    from kvtier.testing import Daemon
    d = Daemon(str(tmp_path), args=["--ram-capacity=64MiB", "--write-mode=ram-only"])
    try:
        client = kvtier_mod.Client(d.target, connect_timeout=30, rpc_deadline=10)
        w = make_worker(client, "outage")
        prompt = random_tokens(100, 95)
        assert w.serve(prompt, "none").stored_chunks == 6
    finally:
        d.close()
    longer = torch.cat([prompt, random_tokens(30, 96)])
    for mode in ("none", "chunk", "layer", "cake"):
        r = w.serve(longer, mode)
        assert r.reused_chunks == 0, mode
        assert r.stored_chunks == 0 and r.put_error, mode
        if mode != "none":
            assert r.fallback, mode
        chunkwise = mode == "cake"
        ref_logits, _ = compute_local(w.model, longer, 0, C, chunkwise_prefix=chunkwise)
        assert torch.equal(r.logits, ref_logits), mode
    client.close()
