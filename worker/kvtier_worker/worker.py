"""The reference worker: serves prompts with a real model and kvtier as its KV cache.

Worker.serve(tokens, mode) runs one prefill:

* ``"none"``:  compute everything, store the full chunks (a cold cache).
* ``"chunk"``: chunk keys -> Lookup -> load the cached prefix whole (get_into, chunk
  order) -> compute the rest -> Put the new full chunks.
* ``"layer"``: the same, but the load streams layer-major in the background and layer
  ``l`` is computed as soon as layer ``l`` of every cached chunk has landed
  (start_get_into / wait_layer), so loading overlaps computing.
* ``"cake"``:  Cake's bidirectional prefill (Client.prefill): the worker computes cached
  chunks forward from 0, one chunk at a time, while the daemon streams them backward
  from h-1; after finish() it computes [compute_begin, compute_end), then the uncached
  rest in one pass.

``"chunk"`` and ``"layer"`` go through KvTierConnector (the vLLM-shaped seam).

Granularity and exactness. A request of n tokens reuses h full chunks (never all of the
prompt: at least the last token is computed, for its logits) and computes [h*C, n) in
one pass given the prefix KV. Cake computes its cached chunks one chunk at a time. The
result equals, bitwise, the same split computed with the prefix KV in local memory
(``compute_local``); against one full pass it differs only by summation order (see
tests/test_worker.py for the bound).

Failures: a load that fails or comes back partial (a chunk evicted between Lookup and
Get) is never used past its verified prefix: the worker recomputes from there. A Cake
session that raises leaves the worker holding only what it computed itself.

serve_truncated(tokens, window) is CachedAttention's context overflow with a pre-RoPE
cache: it drops the oldest whole chunks so the rest fits the window, reuses the cached
chunks that follow at their new positions (K is rotated at use), and computes the rest.
What it computes never attended to the dropped chunks, so it is stored under a key chain
of its own (truncated_keys), which only truncated requests that dropped the same chunks
look up: a full-context request never reuses it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Dict, List, Optional, Tuple

import torch

import kvtier

from .connector import KvTierConnector
from .kv_layout import ChunkLayout
from .model import LlamaModel, ModelConfig

KV = Tuple[torch.Tensor, torch.Tensor]
MODES = ("none", "chunk", "layer", "cake")
COMPUTE_FIT_SAMPLES = 256  # Recent Cake chunk timings compute_estimate fits.


class KvCache:
    """A request's KV in local memory: per layer K and V [heads, capacity, head_dim]."""

    def __init__(self, model: LlamaModel, capacity: int):
        c = model.cfg
        self.k = [torch.empty(c.num_kv_heads, capacity, c.head_dim, dtype=c.dtype)
                  for _ in range(c.num_layers)]
        self.v = [torch.empty_like(t) for t in self.k]

    def write(self, start: int, kv: List[KV]) -> None:
        for l, (k, v) in enumerate(kv):
            self.k[l][:, start:start + k.shape[1]].copy_(k)
            self.v[l][:, start:start + v.shape[1]].copy_(v)

    def write_chunks(self, layout: ChunkLayout, buf: torch.Tensor, first: int, end: int) -> None:
        """Chunks [first, end) of a chunk buffer into token positions [first*C, end*C)."""
        if end > first:
            self.write(first * layout.tokens_per_chunk, layout.unpack(buf, end - first, first))

    def past(self, end: int) -> List[KV]:
        return [(k[:, :end], v[:, :end]) for k, v in zip(self.k, self.v)]


def compute_chunkwise(model: LlamaModel, tokens: torch.Tensor, cache: KvCache, first: int,
                      end: int, C: int, times: Optional[List[Tuple[int, float]]] = None) -> None:
    """Computes chunks [first, end) one at a time (Cake's granularity) into ``cache``,
    which must hold [0, first*C)."""
    for i in range(first, end):
        t0 = time.perf_counter()
        _, kv = model.prefill(tokens[i * C:(i + 1) * C], i * C, cache.past(i * C) if i else None,
                              want_logits=False)
        cache.write(i * C, kv)
        if times is not None:
            times.append((i, time.perf_counter() - t0))


def compute_local(model: LlamaModel, tokens, reused_chunks: int, C: int,
                  chunkwise_prefix: bool = False) -> Tuple[torch.Tensor, List[KV]]:
    """The same computation as a served request, with every KV in local memory: the prefix
    [0, reused_chunks*C) (one pass, or one chunk at a time like Cake), then the rest in
    one pass. Returns (logits of the rest, KV of the whole request)."""
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    n, p = len(tokens), reused_chunks * C
    cache = KvCache(model, n)
    if p:
        if chunkwise_prefix:
            compute_chunkwise(model, tokens, cache, 0, reused_chunks, C)
        else:
            cache.write(0, model.prefill(tokens[:p], want_logits=False)[1])
    logits, kv = model.prefill(tokens[p:], p, cache.past(p) if p else None)
    cache.write(p, kv)
    return logits, cache.past(n)


@dataclass
class ServeResult:
    mode: str
    logits: torch.Tensor           # Logits of the computed tokens [reused_tokens, n).
    kv: List[KV]                   # KV of the whole request, per layer.
    reused_chunks: int             # Chunks whose KV came from kvtier.
    computed_from: int             # First token computed in the final one-pass step.
    stored_chunks: int = 0         # Chunks the Put newly stored.
    fallback: str = ""             # Why the worker recomputed what it meant to load.
    put_error: str = ""            # Why the new chunks were not stored (the result stands).
    timings: Dict[str, float] = field(default_factory=dict)
    chunk_times: List[Tuple[int, float]] = field(default_factory=list)  # Cake compute.
    prefill: Optional[kvtier.PrefillResult] = None
    plan: Optional[object] = None  # PrefillPlan (Cake).


def config_revision(cfg: ModelConfig) -> str:
    """The layout's model_revision: a digest of every field of the model's config (its
    weights come from the seed and the shapes; rope_theta, rms_eps and the rest change
    what KV a prompt gives). Two configs that differ in any field never share chunks."""
    text = repr([(f.name, str(getattr(cfg, f.name))) for f in dataclasses.fields(cfg)])
    return "cfg-" + hashlib.sha256(text.encode()).hexdigest()[:24]


class Worker:
    def __init__(self, model: LlamaModel, client: kvtier.Client, tokens_per_chunk: int = 16,
                 model_id: str = "ref-llama", lease_seconds: Optional[float] = 30.0):
        cfg = model.cfg
        self.model = model
        self.client = client
        self.C = tokens_per_chunk
        self.layout = kvtier.Layout(
            model_id=model_id, model_revision=config_revision(cfg),
            dtype=cfg.dtype_name, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim, tokens_per_chunk=tokens_per_chunk,
            key_position=cfg.key_position)
        self.connector = KvTierConnector(client, self.layout, lease_seconds)
        self.ns = self.connector.ns
        self.chunks = self.connector.chunks
        self._ids = itertools.count()
        # (chunk index, seconds) of recent Cake chunk computations; older ones fall out.
        self._compute_fit: Deque[Tuple[int, float]] = deque(maxlen=COMPUTE_FIT_SAMPLES)

    # -- Prefix reuse through the connector -------------------------------------------

    def serve(self, tokens, mode: str = "layer", put: bool = True,
              max_bytes_per_second: int = 0, return_kv: bool = True) -> ServeResult:
        """Serves one prompt (see the module docstring for the modes). ``return_kv=False``
        skips assembling the whole request's KV in local memory for the result (a copy of
        the prefix a serving engine would not make); result.kv is then None."""
        if mode not in MODES:
            raise ValueError(f"mode: {mode!r} is not one of {MODES}")
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        if tokens.ndim != 1 or len(tokens) == 0:
            raise ValueError("tokens: expected a non-empty 1-D sequence of token ids")
        if mode == "cake":
            return self._serve_cake(tokens, put, max_bytes_per_second)
        t_start = time.perf_counter()
        req = f"req-{next(self._ids)}"
        conn = self.connector
        n, C = len(tokens), self.C
        # However serving ends (a model error, an interrupt), the request is retired: its
        # load thread cancelled and joined, its buffers and lease let go.
        finished = False
        try:
            matched, _ = conn.get_num_new_matched_tokens(req, tokens, lookup=mode != "none")
            h = matched // C
            cache = KvCache(self.model, n)
            result = ServeResult(mode, None, None, 0, 0)
            lookup_error = conn._req(req).lookup_error
            fallback = f"lookup failed: {lookup_error}" if lookup_error is not None else ""
            save = (lambda l, k, v: conn.save_kv_layer(req, l, k, v, h * C)) if put else None
            if h:
                conn.update_state_after_alloc(req)
                conn.start_load_kv(req, order="layer" if mode == "layer" else "chunk")
            t_compute = time.perf_counter()
            logits = kv = None
            if h and mode == "chunk":
                loaded = conn.finish_load(req)
                result.timings["load"] = time.perf_counter() - t_compute
                t_compute = time.perf_counter()
                if loaded == h:
                    past = [conn.chunks.layer_kv(conn._req(req).load_buf, l)
                            for l in range(self.model.cfg.num_layers)]
                    logits, kv = self.model.prefill(tokens[h * C:], h * C, past, on_layer_kv=save)
            elif h and mode == "layer":
                try:
                    logits, kv = self.model.prefill(
                        tokens[h * C:], h * C, lambda l: conn.wait_for_layer_load(req, l),
                        on_layer_kv=save)
                except kvtier.KvTierError as e:
                    fallback = f"load failed: {e}"
                    logits = None
                loaded = conn.finish_load(req)  # The commit point: checksums verified.
                if loaded < h:
                    logits = None
            if h and logits is not None:
                if return_kv:
                    cache.write_chunks(self.chunks, conn._req(req).load_buf, 0, h)
                    cache.write(h * C, kv)
                result.reused_chunks = h
                result.computed_from = h * C
            else:
                # Nothing cached, or the load failed or came back partial: compute the rest
                # from the verified prefix (a failed load verified nothing).
                loaded = conn.finish_load(req) if h else 0
                if h and not fallback:
                    load_error = conn._req(req).load_error
                    fallback = (f"load failed: {load_error}" if load_error is not None
                                else f"partial load: {loaded} of {h} chunks")
                if loaded:
                    cache.write_chunks(self.chunks, conn._req(req).load_buf, 0, loaded)
                p = loaded * C
                if put and h:
                    # The save buffer began at h; restart it at the verified prefix.
                    conn.restart_save(req)
                    save = lambda l, k, v: conn.save_kv_layer(req, l, k, v, p)  # noqa: E731
                logits, kv = self.model.prefill(tokens[p:], p, cache.past(p) if p else None,
                                                on_layer_kv=save)
                cache.write(p, kv)
                result.reused_chunks = loaded
                result.computed_from = p
            result.timings["compute"] = time.perf_counter() - t_compute
            if put:
                t_put = time.perf_counter()
                try:
                    pr = conn.wait_for_save(req)
                    result.stored_chunks = pr.stored if pr is not None else 0
                except kvtier.KvTierError as e:  # The logits stand; the chunks are not cached.
                    result.put_error = str(e)
                result.timings["put_wait"] = time.perf_counter() - t_put
            result.timings.update({f"conn_{k}": v for k, v in conn.timings(req).items()
                                   if k != "load_start"})
            conn.get_finished([req])
            finished = True
            conn.get_failed_loads()
            result.logits, result.fallback = logits, fallback
            result.kv = cache.past(n) if return_kv else None
            result.timings["total"] = time.perf_counter() - t_start
            return result
        finally:
            if not finished:
                conn.get_finished([req])

    # -- Cake -----------------------------------------------------------------------

    def compute_estimate(self) -> Optional[Tuple[float, float]]:
        """(a, b) of chunk i costing a + b*i seconds, least squares over recent Cake chunk
        computations (b >= 0, a >= 0); None before any."""
        pts = list(self._compute_fit)[-COMPUTE_FIT_SAMPLES:]
        if len(pts) < 2:
            return None
        xs = torch.tensor([p[0] for p in pts], dtype=torch.float64)
        ys = torch.tensor([p[1] for p in pts], dtype=torch.float64)
        if float(xs.max() - xs.min()) == 0:
            return (max(0.0, float(ys.mean())), 0.0)
        xm, ym = xs.mean(), ys.mean()
        b = float(((xs - xm) * (ys - ym)).sum() / ((xs - xm) ** 2).sum())
        b = max(0.0, b)
        a = max(0.0, float(ym) - b * float(xm))
        return (a, b)

    def _serve_cake(self, tokens: torch.Tensor, put: bool, max_bytes_per_second: int,
                    compute_estimate: Optional[Tuple[float, float]] = None) -> ServeResult:
        t_start = time.perf_counter()
        n, C = len(tokens), self.C
        keys_all = kvtier.chunk_keys(self.ns, tokens.numpy(), C)
        keys = keys_all[:max(0, (n - 1) // C)]  # Leave >= 1 token to compute.
        cache = KvCache(self.model, n)
        result = ServeResult("cake", None, None, 0, 0)
        times: List[Tuple[int, float]] = []
        h = computed = 0
        if keys:
            dest = self.chunks.alloc(len(keys))
            est = compute_estimate or self.compute_estimate()
            try:
                with self.connector.call(self.client.prefill, self.ns, keys, dest=dest,
                                         compute_estimate=est,
                                         max_bytes_per_second=max_bytes_per_second) as s:
                    result.plan = s.plan
                    h = s.plan.cached_prefix
                    while computed < h and s.should_compute(computed):
                        compute_chunkwise(self.model, tokens, cache, computed, computed + 1,
                                          C, times)
                        s.report_computed(computed)
                        computed += 1
                    r = s.finish()
                result.prefill = r
                # Streamed [s, h); a chunk both computed and streamed (a race on the
                # meeting chunk) keeps the computed copy.
                cache.write_chunks(self.chunks, dest, max(computed, r.first_streamed), h)
                result.timings["session"] = time.perf_counter() - t_start
                compute_chunkwise(self.model, tokens, cache, computed,
                                  max(computed, r.first_streamed), C, times)
            except kvtier.KvTierError as e:
                # Nothing from the session counts: compute the cached prefix ourselves.
                result.fallback = f"prefill session failed: {e}"
                compute_chunkwise(self.model, tokens, cache, computed, h, C, times)
        self._compute_fit.extend(times)
        p = h * C
        t_rest = time.perf_counter()
        logits, kv = self.model.prefill(tokens[p:], p, cache.past(p) if p else None)
        cache.write(p, kv)
        result.timings["rest"] = time.perf_counter() - t_rest
        result.reused_chunks = (max(0, h - max(computed, result.prefill.first_streamed))
                                if result.prefill is not None else 0)
        result.computed_from = p
        if put and n // C > h:
            t_put = time.perf_counter()
            buf = self.chunks.pack([(k[:, p:], v[:, p:]) for k, v in cache.past(n // C * C)])
            try:
                pr = self.connector.call(self.client.put, self.ns, keys_all[h:n // C],
                                         list(buf), chain_start=h,
                                         prev_key=keys_all[h - 1] if h > 0 else None)
                result.stored_chunks = pr.stored
            except kvtier.KvTierError as e:
                result.put_error = str(e)
            result.timings["put"] = time.perf_counter() - t_put
        result.logits, result.kv, result.chunk_times = logits, cache.past(n), times
        result.timings["total"] = time.perf_counter() - t_start
        return result

    def serve_cake(self, tokens, put: bool = True, max_bytes_per_second: int = 0,
                   compute_estimate: Optional[Tuple[float, float]] = None) -> ServeResult:
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        return self._serve_cake(tokens, put, max_bytes_per_second, compute_estimate)

    # -- Context overflow (CachedAttention) -------------------------------------------

    def serve_truncated(self, tokens, window: int, put: bool = True) -> ServeResult:
        """Serves a conversation longer than ``window`` tokens: drops its oldest whole chunks
        until the rest fits, loads the cached chunks that follow, rotates their pre-RoPE
        keys at the new positions 0.. and computes the rest at the positions after them.
        Needs a pre-RoPE model. ``result.computed_from`` is the first computed token in
        the truncated request; ``result.kv``/``logits`` cover the truncated request.

        What it reuses: first the conversation's own chunks (full-context KV, looked up by
        the conversation's keys; deeper layers saw the dropped tokens: CachedAttention's
        approximation), then chunks an earlier truncated request that dropped the same
        chunks computed (truncated_keys). What it computes is stored under
        truncated_keys, never under the conversation's keys: only layer 0's pre-RoPE K
        is free of the context, every other layer's KV depends on what it attended to,
        and a full-context request must not reuse KV that never saw the dropped chunks.
        With nothing dropped (it fits) the request is an ordinary one, keys included."""
        if not self.model.pre_rope:
            raise ValueError("serve_truncated needs a pre-RoPE model (key_position="
                             "'pre_rope'): post-RoPE keys carry their old positions")
        if window < self.C:
            raise ValueError(f"window: {window} tokens, less than one chunk ({self.C})")
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        t_start = time.perf_counter()
        n, C = len(tokens), self.C
        conn = self.connector
        drop = max(0, -(-(n - window) // C))  # Oldest whole chunks dropped.
        keys = kvtier.chunk_keys(self.ns, tokens.numpy(), C)
        # own[j]: where chunk drop + j's KV as computed in this truncated context lives.
        own = truncated_keys(keys[drop - 1], tokens, drop, C) if drop else keys
        u = max(drop, (n - 1) // C) - drop    # Usable chunks (>= 1 token left to compute).
        exact, trunc = keys[drop:drop + u], own[:u]
        used: List[bytes] = []                # Keys of the chunks to load, in order.
        m = 0
        buf = None
        fallback = ""
        if u:
            try:
                tiers = conn.call(self.client.lookup, self.ns,
                                  exact + (trunc if drop else [])).tiers
            except kvtier.KvTierError as e:
                tiers, fallback = [], f"lookup failed: {e}"
            m_exact = _leading_hits(tiers[:u])
            used = exact[:m_exact]
            if drop and tiers:
                used += trunc[m_exact:m_exact + _leading_hits(tiers[u + m_exact:])]
            m = len(used)
        if m:
            buf = self.chunks.alloc(m)
            try:
                r = conn.call(self.client.get_into, self.ns, used, buf)
                if r.prefix_found < m:
                    fallback = f"partial load: {r.prefix_found} of {m} chunks"
                m = r.prefix_found
            except kvtier.KvTierError as e:
                fallback, m = f"load failed: {e}", 0
        base = drop * C                       # Token index where the request now begins.
        sub = tokens[base:]
        cache = KvCache(self.model, len(sub))
        if m:
            cache.write_chunks(self.chunks, buf, 0, m)
        p = m * C
        logits, kv = self.model.prefill(sub[p:], p, cache.past(p) if p else None)
        cache.write(p, kv)
        result = ServeResult("truncated", logits, cache.past(len(sub)), m, p, fallback=fallback)
        if put:
            first, end = drop + m, n // C
            if end > first:
                packed = self.chunks.pack([(k[:, p:(end - drop) * C], v[:, p:(end - drop) * C])
                                           for k, v in cache.past(len(sub))])
                try:
                    result.stored_chunks = conn.call(
                        self.client.put, self.ns, own[m:end - drop], list(packed),
                        chain_start=first, prev_key=own[m - 1] if m else None).stored
                except kvtier.KvTierError as e:
                    result.put_error = str(e)
        result.timings["total"] = time.perf_counter() - t_start
        result.timings["dropped_chunks"] = drop
        return result


def _leading_hits(tiers) -> int:
    """Leading tiers that are not ABSENT: the chunks a request can load in order."""
    return next((i for i, t in enumerate(tiers) if t == kvtier.Tier.ABSENT), len(tiers))


def truncated_keys(dropped_key: bytes, tokens, first: int, C: int) -> List[bytes]:
    """Keys for the KV of chunks [first, len(tokens) // C) of a conversation as computed
    with its chunks [0, first) dropped (serve_truncated). Chained like kvtier.chunk_keys
    (each key hashes the previous one and the chunk's little-endian u32 tokens), but from
    a marker that names the dropped chunks (``dropped_key``, the conversation's key of
    chunk first - 1, chains all of them and the namespace) and with BLAKE2b-128 instead
    of XXH3-128: no full-context request's key can equal one of them, and two truncated
    requests share a key only when they dropped the same tokens and kept the same ones."""
    data = torch.as_tensor(tokens, dtype=torch.long).numpy().astype("<u4").tobytes()
    step = 4 * C
    prev = hashlib.blake2b(b"kvtier-worker/truncated-context/v1" + bytes(dropped_key),
                           digest_size=16).digest()
    keys = []
    for i in range(first, len(data) // step):
        prev = hashlib.blake2b(prev + data[i * step:(i + 1) * step], digest_size=16).digest()
        keys.append(prev)
    return keys
