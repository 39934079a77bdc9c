"""KvTierConnector: the engine seam, modelled on vLLM's KVConnectorBase_V1.

vLLM splits a KV connector into a scheduler side and a worker side. The same split here,
for one model shard, with requests named by an id:

scheduler side
  get_num_new_matched_tokens(req_id, tokens, num_computed_tokens) -> (tokens, load_async)
      Chunk keys -> Lookup. The match is capped one token short of the prompt, so the
      engine always computes at least the last token (it needs its logits).
  update_state_after_alloc(req_id, buffer)
      The engine hands over the buffer the cached prefix lands in (a ChunkLayout buffer
      of ``matched chunks``; allocated here when None).

worker side
  start_load_kv(req_id, order)          starts the load (layer-major by default)
  wait_for_layer_load(req_id, layer)    blocks until ``layer`` of every chunk landed and
                                        returns that layer's (K, V) of the prefix
  save_kv_layer(req_id, layer, K, V)    the new tokens' KV of one layer, as the forward
                                        pass produces it; the Put starts after the last
  wait_for_save(req_id)                 blocks until the Puts are done
  get_finished(finished_req_ids)        -> (finished_sending, finished_recving)
  get_failed_loads()                    -> {req_id: chunks that did load}; the engine
                                        recomputes the rest (vLLM's
                                        get_block_ids_with_load_errors)

Commit rule (kvtier.LoadHandle): landed layers may be computed on at once, but
whole-chunk checksums are verified only once whole chunks are in (in a layer-major load,
every chunk's when the stream ends), so ``finish_load`` (wait()) must succeed before
anything computed from the load is kept or stored. The worker calls it before returning
logits; the Put of a save waits for it. The rule holds for every save of a request that
matched chunks, whether or not its load started: a load that failed to start verified
nothing, so only KV computed from token 0 (a full recomputation) is stored then.

Leases: get_num_new_matched_tokens asks Lookup for a lease (``lease_seconds``), so the
matched chunks that are in the daemon's RAM cannot be evicted before start_load_kv's Get,
which names the lease and so ends it. A request that never loads releases it in
get_finished (or when it is asked about again), and so does a load that fails to start,
fails or is cancelled (finish_load, get_finished): its Get may never have reached the
daemon (refused at admission, the daemon unreachable), and a refused Get ends no lease.
A hit the lease does not cover (on SSD, or no lease granted because the daemon is at its
lease bounds) can still be gone by the Get: it shows up as a partial load (``found``
false), reported through get_failed_loads, and the engine recomputes it.

Save passes: each forward pass over the request (chunked prefill runs several) is a pass
of its own, with its own chunks and Put. A pass begins when save_kv_layer sees a start
token other than the current pass's, or a layer the current pass already has; the
previous pass's Put is joined first. A pass that never got every layer had no Put and is
dropped (the engine abandoned that forward pass). wait_for_save reports every pass that
ended since the last call, once. A chunk that straddles two passes (a pass ending
mid-chunk, the next starting where it ended) is stored by the later pass: each complete
pass keeps its trailing partial chunk's KV (one chunk's worth per layer at most) and the
next pass prepends it when it starts at that token. The kept tail is dropped when the
next pass starts anywhere else, by restart_save, and when the request is forgotten.

Registration: the constructor registers the layout if it can; if it cannot (the daemon
is down) the connector is built anyway and registers before the first call that needs
it. It registers again when the daemon answers NOT_FOUND (it restarted with an empty
data directory and forgot the namespace) and retries that call once. The namespace id is
computed locally (Layout.namespace_id). Both degraded cases log a warning.

Ending a request: get_finished([req]) cancels a load still running and joins it before it
forgets the request, so nothing writes into the engine's buffer once it returns. Asking
get_num_new_matched_tokens again for a known request (vLLM re-asks while a request
waits, and after a preemption) first ends the old one the same way, lease included.

Threading: one connector may serve many requests; its own state is guarded by a lock.
Each request's calls come from one engine thread, in the order above. Put threads (one
per save pass) read only their pass's buffer and write only their pass's result.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

import torch

import kvtier

from .kv_layout import ChunkLayout

KV = Tuple[torch.Tensor, torch.Tensor]
log = logging.getLogger(__name__)


@dataclass
class _SavePass:
    """One forward pass's save: the full chunks among its tokens, and their Put."""
    start_token: int                 # Token index of the pass's first new token.
    end_token: int                   # One past its last new token.
    first: int                       # First chunk index the buffer holds.
    buf: torch.Tensor                # [chunks, layers, 2, heads, C, head_dim].
    # The previous pass's tail, KV of tokens [head_start, start_token) per layer (a chunk
    # straddling both passes), prepended to this pass's KV; None when there is none.
    head: Optional[Dict[int, KV]] = None
    head_start: int = 0              # Token index of the head's (else the pass's) first.
    # KV of this pass's trailing partial chunk, [end_token // C * C, end_token), per layer,
    # for the next pass to prepend; left empty when no stored chunk could use it.
    tail: Dict[int, KV] = field(default_factory=dict)
    layers: Set[int] = field(default_factory=set)  # Layers copied in so far.
    thread: Optional[threading.Thread] = None      # The Put, once every layer is in.
    result: Optional[kvtier.PutResult] = None      # Written by the Put thread only.
    error: Optional[BaseException] = None          # Written by the Put thread only.
    settled: bool = False            # Joined and folded into the request's outcome.


@dataclass
class _Request:
    req_id: str
    tokens: torch.Tensor
    keys: List[bytes]
    matched_chunks: int = 0          # Chunks the engine will load.
    lease: int = 0                   # Lookup lease on the match; 0: none.
    load_lease: int = 0              # The lease the load's Get names (_release_load_lease).
    lookup_error: Optional[BaseException] = None  # The Lookup failed: nothing matched.
    load_buf: Optional[torch.Tensor] = None
    handle: Optional[kvtier.LoadHandle] = None
    load_result: Optional[kvtier.GetResult] = None
    load_error: Optional[BaseException] = None
    loaded_chunks: int = 0           # Leading chunks verified after finish_load.
    recv_done: bool = False          # The load ended and is in finished_recving (once).
    save: Optional[_SavePass] = None  # The current save pass.
    put_results: List[kvtier.PutResult] = field(default_factory=list)  # Passes not yet
    put_error: Optional[BaseException] = None  # reported by wait_for_save (first error).
    timings: Dict[str, float] = field(default_factory=dict)


class KvTierConnector:
    def __init__(self, client: kvtier.Client, layout: kvtier.Layout,
                 lease_seconds: Optional[float] = 30.0):
        self.client = client
        self.layout = layout
        self.chunks = ChunkLayout.from_kvtier(layout)
        self.ns = layout.namespace_id  # Computed locally (see "Registration").
        self.C = layout.tokens_per_chunk
        self.lease_seconds = int(lease_seconds or 0)
        self._lock = threading.Lock()
        self._registered = False
        self._reqs: Dict[str, _Request] = {}
        self._finished_recving: Set[str] = set()
        self._finished_sending: Set[str] = set()
        self._failed: Dict[str, int] = {}
        try:
            self._ensure_registered()
        except kvtier.KvTierError as e:
            # The cache is a shortcut: serve without it until the daemon answers.
            log.warning("kvtier: registering layout %r (namespace %#x) failed, retrying "
                        "before the next call: %s", layout.model_id, self.ns, e)

    def _req(self, req_id: str) -> _Request:
        with self._lock:
            try:
                return self._reqs[req_id]
            except KeyError:
                raise KeyError(f"request {req_id!r}: unknown to the connector "
                               "(get_num_new_matched_tokens first)") from None

    # -- Registration -----------------------------------------------------------------

    def _ensure_registered(self) -> None:
        """Registers the layout unless it is already. Raises KvTierError (the daemon's,
        or InternalError when it names another namespace id than the layout's)."""
        with self._lock:
            if self._registered:
                return
        # Outside the lock: two threads may both register, which is idempotent.
        ns = self.client.register_layout(self.layout).namespace_id
        if ns != self.ns:
            raise kvtier.InternalError(f"the daemon registered the layout as namespace "
                                       f"{ns:#x}; Layout.namespace_id is {self.ns:#x}")
        with self._lock:
            self._registered = True

    def _forget_registration(self, e: BaseException) -> None:
        """NOT_FOUND means the daemon does not know the namespace (any more)."""
        if isinstance(e, kvtier.NotFoundError):
            with self._lock:
                self._registered = False

    def call(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)``, a client call on this connector's namespace, with the
        layout registered first; on NOT_FOUND it registers again and retries once (a
        daemon restarted on an empty data directory). Raises what fn or RegisterLayout
        raise."""
        self._ensure_registered()
        try:
            return fn(*args, **kwargs)
        except kvtier.NotFoundError as e:
            self._forget_registration(e)
            log.warning("kvtier: namespace %#x unknown to the daemon (restarted empty?); "
                        "registering again: %s", self.ns, e)
        self._ensure_registered()
        return fn(*args, **kwargs)

    # -- Scheduler side ---------------------------------------------------------------

    def get_num_new_matched_tokens(self, req_id: str, tokens, num_computed_tokens: int = 0,
                                   lookup: bool = True) -> Tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` that kvtier can supply, and whether the load
        is asynchronous (True when there is one: start_load_kv runs in the background).
        ``lookup=False`` registers the request for saving only (a cold prefill). Asking
        again for a known request ends its previous state first (its lease released, a
        running load cancelled and joined) and matches afresh."""
        with self._lock:
            old = self._reqs.pop(req_id, None)
        if old is not None:
            self._retire(old)
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        t0 = time.perf_counter()
        keys = kvtier.chunk_keys(self.ns, tokens.numpy(), self.C)
        usable = max(0, (len(tokens) - 1) // self.C)  # Leave >= 1 token to compute.
        keys = keys[:usable]
        req = _Request(req_id, tokens, keys)
        if keys and lookup:
            try:
                lk = self.call(self.client.lookup, self.ns, keys,
                               lease_seconds=self.lease_seconds)
                req.lease = lk.lease
                req.matched_chunks = lk.prefix_hits
            except kvtier.KvTierError as e:
                # The cache is a shortcut, never a dependency: an unreachable or failing
                # daemon means a cold prefill, computed in full.
                req.lookup_error = e
        req.timings["lookup"] = time.perf_counter() - t0
        with self._lock:
            self._reqs[req_id] = req
        matched = max(0, req.matched_chunks * self.C - num_computed_tokens)
        return matched, matched > 0

    def update_state_after_alloc(self, req_id: str, buffer: Optional[torch.Tensor] = None
                                 ) -> torch.Tensor:
        """Raises TypeError / ValueError for a buffer that is not a CPU chunk buffer of the
        match's size (ChunkLayout.check_buffer)."""
        req = self._req(req_id)
        if buffer is None:
            buffer = self.chunks.alloc(req.matched_chunks)
        elif self.chunks.check_buffer(buffer, "buffer") != req.matched_chunks:
            raise ValueError(f"buffer: {buffer.shape[0]} chunks, the match is "
                             f"{req.matched_chunks}")
        req.load_buf = buffer
        return buffer

    # -- Worker side: loads -------------------------------------------------------------

    def start_load_kv(self, req_id: str, order: str = "layer") -> None:
        """order: "layer" (layer-major stream: layer 0 of every chunk first) or "chunk"
        (whole chunks in order; wait_for_layer_load then waits for the whole load). The
        Get names the request's lease, which ends with it. A load that cannot start is a
        failed load: wait_for_layer_load raises its error, get_failed_loads and
        finished_recving report it."""
        req = self._req(req_id)
        if req.matched_chunks == 0:
            return
        if req.load_buf is None:
            self.update_state_after_alloc(req_id)
        req.timings["load_start"] = time.perf_counter()
        keys = req.keys[:req.matched_chunks]
        req.load_lease, req.lease = req.lease, 0  # The Get ends it.
        try:
            req.handle = self.call(self.client.start_get_into, self.ns, keys, req.load_buf,
                                   order=order, lease=req.load_lease)
        except kvtier.KvTierError as e:  # Reported as a failed load: nothing loaded.
            self._load_failed(req, e)
            self._release_load_lease(req)  # No Get ran to end it.
            req.recv_done = True
            with self._lock:
                self._finished_recving.add(req_id)

    def wait_for_layer_load(self, req_id: str, layer: int) -> Optional[KV]:
        """Blocks until ``layer`` of the prefix landed; returns its (K, V) [heads, h*C, d],
        or None when nothing is to be loaded (no match). Raises the load's error,
        including that of a load that could not start."""
        req = self._req(req_id)
        if req.load_error is not None:
            raise req.load_error
        if req.handle is None:
            return None
        try:
            req.handle.wait_layer(layer)
        except BaseException as e:
            self._load_failed(req, e)
            raise
        return self.chunks.layer_kv(req.load_buf, layer)

    def finish_load(self, req_id: str) -> int:
        """Waits for the whole load and its checksums; returns the leading chunks loaded.
        A failed or partial load is recorded for get_failed_loads, not raised; a failed one
        releases its lease. The first call puts the request in finished_recving, however
        the load ended."""
        req = self._req(req_id)
        if req.handle is None or req.recv_done:
            return req.loaded_chunks
        req.recv_done = True
        try:
            result = req.handle.wait()
            if req.load_error is None:  # Else a layer wait already failed: nothing counts.
                req.load_result = result
                req.loaded_chunks = result.prefix_found
                req.timings["load"] = time.perf_counter() - req.timings["load_start"]
        except BaseException as e:  # Reported through get_failed_loads.
            self._load_failed(req, e)
            self._release_load_lease(req)
        with self._lock:
            if req.loaded_chunks < req.matched_chunks:
                self._failed[req_id] = req.loaded_chunks
            self._finished_recving.add(req_id)
        return req.loaded_chunks

    def _load_failed(self, req: _Request, e: BaseException) -> None:
        req.load_error = e
        req.loaded_chunks = 0
        self._forget_registration(e)
        with self._lock:
            self._failed[req.req_id] = 0

    def _verified_chunks(self, req: _Request) -> int:
        """Leading chunks of the match the load verified (waits for the load); 0 when it
        failed or never started."""
        if req.handle is None or req.load_error is not None:
            return 0
        try:
            return req.handle.wait().prefix_found
        except BaseException:  # The load's error is the load's to report (finish_load).
            return 0

    # -- Worker side: saves -------------------------------------------------------------

    def save_kv_layer(self, req_id: str, layer: int, k: torch.Tensor, v: torch.Tensor,
                      start_token: int) -> None:
        """The KV of one layer for the request's tokens [start_token, start_token + T).
        Full chunks among them (with the previous pass's tail, a chunk that straddles
        both) are copied into the pass's save buffer; after the pass's last layer its Put
        starts in the background. A new start token, or a layer the
        pass already has, begins a new pass (see "Save passes")."""
        req = self._req(req_id)
        sp = req.save
        if sp is None or sp.start_token != start_token or layer in sp.layers:
            sp = self._begin_save_pass(req, start_token, k.shape[1])
        if sp.head is not None:  # The straddling chunk's first part, from the last pass.
            hk, hv = sp.head[layer]
            k, v = torch.cat((hk, k), 1), torch.cat((hv, v), 1)
        C = self.C
        n = sp.buf.shape[0]
        if n:
            H, _, d = self.chunks.block_shape
            off = sp.first * C - sp.head_start
            for j, t in enumerate((k, v)):
                src = t[:, off:off + n * C].reshape(H, n, C, d).transpose(0, 1)
                sp.buf[:, layer, j].copy_(src)
        tail_start = sp.end_token // C * C
        # Kept only if this pass has the chunk's KV from its first token (from the pass
        # or its head) and the chunk is one a pass stores (a full chunk of the prompt).
        if (sp.head_start <= tail_start < sp.end_token
                and tail_start // C < len(req.tokens) // C):
            off = tail_start - sp.head_start
            sp.tail[layer] = (k[:, off:].clone(), v[:, off:].clone())
        sp.layers.add(layer)
        if len(sp.layers) == self.layout.num_layers:
            sp.head = None  # Copied into every layer's chunks and tail: not needed now.
            sp.thread = threading.Thread(target=self._put, args=(req, sp),
                                         name="kvtier-save", daemon=True)
            sp.thread.start()

    def _begin_save_pass(self, req: _Request, start_token: int, num_tokens: int) -> _SavePass:
        if req.save is not None:
            # Its Put reads its own buffer; join it so the passes' Puts do not overlap
            # and its outcome reaches wait_for_save. An incomplete pass had no Put.
            self._settle(req, req.save)
        C = self.C
        prev = req.save
        head, head_start = None, start_token
        if (prev is not None and prev.end_token == start_token and prev.tail
                and len(prev.layers) == self.layout.num_layers):
            # The previous pass ended mid-chunk where this one starts: the chunk that
            # straddles them is this pass's to store, with the previous pass's part.
            head, head_start = prev.tail, start_token // C * C
        first = -(-head_start // C)
        end_token = start_token + num_tokens
        end = min(end_token // C, len(req.tokens) // C)
        req.save = _SavePass(start_token, end_token, first,
                             self.chunks.alloc(max(0, end - first)), head, head_start)
        if prev is not None:
            prev.tail = {}  # Handed on, or of no use to a pass that starts elsewhere.
        return req.save

    def _settle(self, req: _Request, sp: _SavePass) -> None:
        """Joins a pass's Put (if it started) and folds its outcome into the request's."""
        if sp.thread is None or sp.settled:
            return
        sp.thread.join()
        sp.settled = True
        if sp.result is not None:
            req.put_results.append(sp.result)
        if sp.error is not None and req.put_error is None:
            req.put_error = sp.error

    def _put(self, req: _Request, sp: _SavePass) -> None:
        t0 = time.perf_counter()
        n = sp.buf.shape[0]
        # The commit rule: the pass's KV was computed on the prefix [0, start_token), of
        # which [0, matched_chunks * C) was to come from the load; it is stored only once
        # the load's checksums verified that part (nothing, if the load never started).
        loaded_part = min(sp.start_token, req.matched_chunks * self.C)
        if n and loaded_part > 0 and self._verified_chunks(req) * self.C < loaded_part:
            req.timings["put_skipped"] = 1.0
            n = 0
        try:
            if n:
                keys = kvtier.chunk_keys(self.ns, req.tokens.numpy(), self.C)
                first = sp.first
                sp.result = self.call(
                    self.client.put, self.ns, keys[first:first + n], list(sp.buf),
                    chain_start=first, prev_key=keys[first - 1] if first > 0 else None)
        except BaseException as e:  # Handed to wait_for_save.
            sp.error = e
        req.timings["put"] = time.perf_counter() - t0
        with self._lock:
            self._finished_sending.add(req.req_id)

    def wait_for_save(self, req_id: str) -> Optional[kvtier.PutResult]:
        """Joins the Puts of the passes that ended since the last call and reports them
        (their counts summed); None when nothing was put (no full chunk, or KV computed
        from a load that failed verification). Raises the first Put error among them."""
        req = self._req(req_id)
        if req.save is not None:
            self._settle(req, req.save)
        results, req.put_results = req.put_results, []
        error, req.put_error = req.put_error, None
        if error is not None:
            raise error
        if not results:
            return None
        if len(results) == 1:
            return results[0]
        return kvtier.PutResult(sum(r.stored for r in results),
                                sum(r.already_present for r in results),
                                sum(r.bytes for r in results))

    # -- Bookkeeping ------------------------------------------------------------------

    def get_finished(self, finished_req_ids=()) -> Tuple[Set[str], Set[str]]:
        """(finished_sending, finished_recving) since the last call. Requests named in
        ``finished_req_ids`` are forgotten: a load still running is cancelled and joined
        first, so once this returns nothing writes into their buffers; a lease never
        used by a load, or named by one that failed or was cancelled, is released."""
        with self._lock:
            sending, self._finished_sending = self._finished_sending, set()
            recving, self._finished_recving = self._finished_recving, set()
            dropped = [self._reqs.pop(r, None) for r in finished_req_ids]
        for req in dropped:
            if req is not None:
                self._retire(req)
        return sending, recving

    def _retire(self, req: _Request) -> None:
        """Ends a request the connector forgets: its load stopped, its lease released, a
        kept tail (see "Save passes") dropped."""
        if req.save is not None:
            # A running Put still holds the request; the tail KV need not live as long.
            req.save.tail, req.save.head = {}, None
        if req.handle is not None and not req.handle.done():
            req.handle.cancel()
        if req.handle is not None:
            try:
                req.handle.wait()  # Joins it: the load writes nothing after this.
            except BaseException:
                # Cancelled or failed: the request is over, so how its load ended no
                # longer matters (a failure finish_load saw is in get_failed_loads), but
                # its Get may have left the lease held.
                self._release_load_lease(req)
        if req.lease:
            # Matched but never loaded: give the held chunks back now, not at expiry.
            self._release_lease(req.lease)
            req.lease = 0

    def _release_load_lease(self, req: _Request) -> None:
        """After a load that failed or was cancelled: its Get may never have reached the
        daemon (refused at admission or by the client's checks, the daemon unreachable,
        cancelled before it was sent), and a Get refused before it starts leaves the lease
        it names held. Releasing a lease the Get did end just answers False."""
        lease, req.load_lease = req.load_lease, 0
        self._release_lease(lease)

    def _release_lease(self, lease: int) -> None:
        if not lease:
            return
        try:
            self.client.release_lease(self.ns, lease)
        except kvtier.KvTierError:  # The daemon ends it at expiry (lease_seconds) anyway.
            pass

    def get_failed_loads(self) -> Dict[str, int]:
        with self._lock:
            failed, self._failed = self._failed, {}
        return failed

    def restart_save(self, req_id: str) -> None:
        """Drops what save_kv_layer gathered and any unreported Put outcome (after joining
        a Put it started), so the engine can save a recomputation from another start
        token."""
        req = self._req(req_id)
        if req.save is not None and req.save.thread is not None:
            req.save.thread.join()
        req.save, req.put_results, req.put_error = None, [], None

    def timings(self, req_id: str) -> Dict[str, float]:
        return dict(self._req(req_id).timings)

    def request_keys(self, req_id: str) -> List[bytes]:
        return self._req(req_id).keys
