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
  wait_for_save(req_id)                 blocks until the Put is done
  get_finished(finished_req_ids)        -> (finished_sending, finished_recving)
  get_failed_loads()                    -> {req_id: chunks that did load}; the engine
                                        recomputes the rest (vLLM's
                                        get_block_ids_with_load_errors)

Commit rule (kvtier.LoadHandle): landed layers may be computed on at once, but whole-chunk
checksums are verified only when each chunk's last layer lands, so ``finish_load``
(wait()) must succeed before anything computed from the load is kept or stored. The
worker calls it before returning logits or saving.

Leases: get_num_new_matched_tokens asks Lookup for a lease (``lease_seconds``), so the
matched chunks that are in the daemon's RAM cannot be evicted before start_load_kv's Get,
which names the lease and so ends it. A request that never loads releases it in
get_finished. A hit the lease does not cover (on SSD, or no lease granted because the
daemon is at its lease bounds) can still be gone by the Get: it shows up as a partial
load (``found`` false), reported through get_failed_loads, and the engine recomputes it.

Threading: one connector may serve many requests; its own state is guarded by a lock.
Each request's calls come from one engine thread, in the order above.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

import torch

import kvtier

from .kv_layout import ChunkLayout

KV = Tuple[torch.Tensor, torch.Tensor]


@dataclass
class _Request:
    req_id: str
    tokens: torch.Tensor
    keys: List[bytes]
    matched_chunks: int = 0          # Chunks the engine will load.
    lease: int = 0                   # Lookup lease on the match; 0: none.
    lookup_error: Optional[BaseException] = None  # The Lookup failed: nothing matched.
    load_buf: Optional[torch.Tensor] = None
    handle: Optional[kvtier.LoadHandle] = None
    load_result: Optional[kvtier.GetResult] = None
    load_error: Optional[BaseException] = None
    loaded_chunks: int = 0           # Leading chunks verified after finish_load.
    save_first: int = 0              # First chunk index the save buffer holds.
    save_buf: Optional[torch.Tensor] = None
    save_start_token: int = 0        # Token index of the first new token.
    layers_saved: Set[int] = field(default_factory=set)
    save_thread: Optional[threading.Thread] = None
    put_result: Optional[kvtier.PutResult] = None
    put_error: Optional[BaseException] = None
    timings: Dict[str, float] = field(default_factory=dict)


class KvTierConnector:
    def __init__(self, client: kvtier.Client, layout: kvtier.Layout,
                 lease_seconds: Optional[float] = 30.0):
        self.client = client
        self.layout = layout
        self.chunks = ChunkLayout.from_kvtier(layout)
        self.ns = client.register_layout(layout).namespace_id
        self.C = layout.tokens_per_chunk
        self.lease_seconds = int(lease_seconds or 0)
        self._lock = threading.Lock()
        self._reqs: Dict[str, _Request] = {}
        self._finished_recving: Set[str] = set()
        self._finished_sending: Set[str] = set()
        self._failed: Dict[str, int] = {}

    def _req(self, req_id: str) -> _Request:
        with self._lock:
            try:
                return self._reqs[req_id]
            except KeyError:
                raise KeyError(f"request {req_id!r}: unknown to the connector "
                               "(get_num_new_matched_tokens first)") from None

    # -- Scheduler side ---------------------------------------------------------------

    def get_num_new_matched_tokens(self, req_id: str, tokens, num_computed_tokens: int = 0,
                                   lookup: bool = True) -> Tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` that kvtier can supply, and whether the load
        is asynchronous (True when there is one: start_load_kv runs in the background).
        ``lookup=False`` registers the request for saving only (a cold prefill)."""
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        t0 = time.perf_counter()
        keys = kvtier.chunk_keys(self.ns, tokens.numpy(), self.C)
        usable = max(0, (len(tokens) - 1) // self.C)  # Leave >= 1 token to compute.
        keys = keys[:usable]
        req = _Request(req_id, tokens, keys)
        if keys and lookup:
            try:
                lk = self.client.lookup(self.ns, keys, lease_seconds=self.lease_seconds)
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
        Get names the request's lease, which ends with it."""
        req = self._req(req_id)
        if req.matched_chunks == 0:
            return
        if req.load_buf is None:
            self.update_state_after_alloc(req_id)
        req.timings["load_start"] = time.perf_counter()
        keys = req.keys[:req.matched_chunks]
        lease, req.lease = req.lease, 0  # The Get ends it.
        try:
            req.handle = self.client.start_get_into(self.ns, keys, req.load_buf, order=order,
                                                    lease=lease)
        except kvtier.KvTierError as e:  # Reported as a failed load: nothing loaded.
            self._load_failed(req, e)
            with self._lock:
                self._finished_recving.add(req_id)

    def wait_for_layer_load(self, req_id: str, layer: int) -> Optional[KV]:
        """Blocks until ``layer`` of the prefix landed; returns its (K, V) [heads, h*C, d],
        or None when nothing is loaded. Raises the load's error."""
        req = self._req(req_id)
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
        A failed or partial load is recorded for get_failed_loads, not raised."""
        req = self._req(req_id)
        if req.handle is None:
            return 0
        if req.load_result is None and req.load_error is None:
            try:
                req.load_result = req.handle.wait()
                req.loaded_chunks = req.load_result.prefix_found
                req.timings["load"] = time.perf_counter() - req.timings["load_start"]
            except BaseException as e:  # Reported through get_failed_loads.
                self._load_failed(req, e)
            if req.loaded_chunks < req.matched_chunks:
                with self._lock:
                    self._failed[req_id] = req.loaded_chunks
            with self._lock:
                self._finished_recving.add(req_id)
        return req.loaded_chunks

    def _load_failed(self, req: _Request, e: BaseException) -> None:
        req.load_error = e
        req.loaded_chunks = 0
        with self._lock:
            self._failed[req.req_id] = 0

    # -- Worker side: saves -------------------------------------------------------------

    def save_kv_layer(self, req_id: str, layer: int, k: torch.Tensor, v: torch.Tensor,
                      start_token: int) -> None:
        """The KV of one layer for the request's tokens [start_token, start_token + T).
        Full chunks among them are copied into the save buffer; after the last layer the
        Put of those chunks starts in the background."""
        req = self._req(req_id)
        C = self.C
        T = k.shape[1]
        first = -(-start_token // C)
        end = (start_token + T) // C
        end = min(end, len(req.tokens) // C)
        if req.save_buf is None:
            req.save_first = first
            req.save_start_token = start_token
            req.save_buf = self.chunks.alloc(max(0, end - first))
        n = req.save_buf.shape[0]
        if n:
            H, _, d = self.chunks.block_shape
            off = first * C - start_token
            for j, t in enumerate((k, v)):
                src = t[:, off:off + n * C].reshape(H, n, C, d).transpose(0, 1)
                req.save_buf[:, layer, j].copy_(src)
        req.layers_saved.add(layer)
        if len(req.layers_saved) == self.layout.num_layers:
            req.save_thread = threading.Thread(target=self._put, args=(req,),
                                               name="kvtier-save", daemon=True)
            req.save_thread.start()

    def _put(self, req: _Request) -> None:
        t0 = time.perf_counter()
        n = req.save_buf.shape[0]
        if req.handle is not None and req.save_start_token > 0:
            # The commit rule: KV computed from a load is stored only once the load's
            # checksums verified the prefix it was computed from.
            try:
                verified = req.handle.wait().prefix_found
            except BaseException:  # The load's error is the load's to report.
                verified = 0
            if verified * self.C < req.save_start_token:
                req.timings["put_skipped"] = 1.0
                n = 0
        try:
            if n:
                keys = kvtier.chunk_keys(self.ns, req.tokens.numpy(), self.C)
                first = req.save_first
                req.put_result = self.client.put(
                    self.ns, keys[first:first + n], list(req.save_buf), chain_start=first,
                    prev_key=keys[first - 1] if first > 0 else None)
        except BaseException as e:  # Handed to wait_for_save.
            req.put_error = e
        req.timings["put"] = time.perf_counter() - t0
        with self._lock:
            self._finished_sending.add(req.req_id)

    def wait_for_save(self, req_id: str) -> Optional[kvtier.PutResult]:
        """Joins the Put; None when nothing was put (no full chunk, or a save computed from
        a load that failed verification). Raises the Put's error."""
        req = self._req(req_id)
        if req.save_thread is not None:
            req.save_thread.join()
        if req.put_error is not None:
            raise req.put_error
        return req.put_result

    # -- Bookkeeping ------------------------------------------------------------------

    def get_finished(self, finished_req_ids=()) -> Tuple[Set[str], Set[str]]:
        """(finished_sending, finished_recving) since the last call; requests named in
        ``finished_req_ids`` are forgotten once both their load and save are done."""
        with self._lock:
            sending, self._finished_sending = self._finished_sending, set()
            recving, self._finished_recving = self._finished_recving, set()
            dropped = [self._reqs.pop(r, None) for r in finished_req_ids]
        for req in dropped:
            if req is not None and req.lease:
                # Matched but never loaded: give the held chunks back now, not at expiry.
                self.client.release_lease(self.ns, req.lease)
                req.lease = 0
        return sending, recving

    def get_failed_loads(self) -> Dict[str, int]:
        with self._lock:
            failed, self._failed = self._failed, {}
        return failed

    def restart_save(self, req_id: str) -> None:
        """Drops what save_kv_layer gathered (after joining a Put it started), so the
        engine can save a recomputation from another start token."""
        req = self._req(req_id)
        if req.save_thread is not None:
            req.save_thread.join()
        req.save_buf, req.layers_saved, req.save_thread = None, set(), None
        req.put_result = req.put_error = None

    def timings(self, req_id: str) -> Dict[str, float]:
        return dict(self._req(req_id).timings)

    def request_keys(self, req_id: str) -> List[bytes]:
        return self._req(req_id).keys
