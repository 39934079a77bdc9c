"""kvtier.PrefillSession: the worker's side of a Cake prefill.

Same contract as the C++ PrefillSession (client/prefill_session.h) and the "Prefill"
block of proto/kvtier/v1/kvtier.proto. The worker computes chunks forward from 0 while
the daemon streams cached chunks backward from h-1::

    with client.prefill(ns, keys, dest=kv_buffer, compute_estimate=(a, b)) as s:
        i = 0
        while i < s.plan.cached_prefix and s.should_compute(i):
            compute(i)
            s.report_computed(i)
            i += 1
        r = s.finish()
    # Chunks [r.first_streamed, h) are in kv_buffer; compute
    # [r.compute_begin, r.compute_end), then the uncached [h, n).

Exactly once: streamed chunks reach ``dest`` (or ``on_chunk``) only whole and
CRC32C-verified, each once. If finish() raises, the worker holds nothing from the
session: it computes [0, h) itself.

``on_chunk`` runs on the session's own thread. It may call should_compute and
report_computed, and may drop the session (another thread then ends it); finish() and
close() from it raise FailedPreconditionError, since they wait for that thread.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import List

from . import _native
from ._buffers import byte_view
from ._layout import Tier
from .client import _seconds, _whole, native_error
from .errors import FailedPreconditionError, InvalidArgumentError, KvTierError
from .v1 import kvtier_pb2


def _reason_name(value: int) -> str:
    """PrefillDone.Reason's name; a reason a newer daemon added keeps its number."""
    try:
        return kvtier_pb2.PrefillDone.Reason.Name(value)
    except ValueError:
        return f"REASON_{value}"


@dataclass(frozen=True)
class PrefillResult:
    first_streamed: int      # s: chunks [s, h) were streamed.
    cached_prefix: int       # h.
    reason: str              # PrefillDone.Reason name, e.g. "MET", "ALL_STREAMED".
    detail: str
    sources: List[str]       # Per cached chunk: "computed" below s, "streamed" from s.
    chunks_streamed: int
    bytes_streamed: int
    bytes_discarded: int
    computed_reported: int
    compute_begin: int       # Cached chunks the worker still computes:
    compute_end: int         # [compute_begin, compute_end).
    raced: int
    elapsed_seconds: float
    daemon_elapsed_seconds: float
    # How streamed chunks came: "shared_memory" (dest is client.shared_buffer() memory
    # on the daemon's host: the daemon wrote them there) or "stream".
    path: str = "stream"


def _release_elsewhere(holder: list) -> None:
    """Called by the native session when a callback dropped the last reference to it:
    ``holder`` holds that reference, and a thread of its own drops it, as the session's
    destructor joins the thread the callback ran on. Not a daemon thread: the interpreter
    waits for it at exit instead of stopping it inside the destructor."""
    threading.Thread(target=holder.clear, name="kvtier-prefill-release").start()


class PrefillSession:
    """Created by Client.prefill(); see the module docstring."""

    def __init__(self, client, namespace_id: int, keys, *, dest, on_chunk, compute_estimate,
                 max_bytes_per_second, max_frame_bytes, rpc_deadline, use_forecast,
                 device_dest=None, on_in_place=None):
        if sum(x is not None for x in (dest, on_chunk, device_dest)) > 1:
            raise InvalidArgumentError("pass one of dest, on_chunk and device_dest")
        if on_in_place is not None and device_dest is None:
            raise InvalidArgumentError("on_in_place: only with device_dest")
        native_device = None
        if device_dest is not None:
            region, offset = device_dest
            native_device = (region.region_id, region.token, region.nbytes, int(offset))
        in_place = None
        if on_in_place is not None:
            def in_place(index, tier):
                on_in_place(index, Tier(tier))
        layout = client.layout(namespace_id)
        view = None
        if dest is not None:
            view = byte_view(dest, "dest", writable=True, dtype=layout.dtype if layout else None)
            if layout is not None and view.nbytes < len(keys) * layout.chunk_bytes:
                raise InvalidArgumentError(
                    f"dest: {view.nbytes} bytes; {len(keys)} chunks need "
                    f"{len(keys) * layout.chunk_bytes}")
        callback = None
        if on_chunk is not None:
            def callback(index, data, tier):
                on_chunk(index, data, Tier(tier))
        if compute_estimate is not None:
            try:
                compute_estimate = (float(compute_estimate[0]), float(compute_estimate[1]))
            except (TypeError, ValueError, IndexError) as e:
                raise InvalidArgumentError(
                    f"compute_estimate: (seconds per chunk, seconds fixed), got "
                    f"{compute_estimate!r}") from e
        args = (client._native.raw("prefill"), namespace_id, keys, view, callback,
                compute_estimate, _whole("max_bytes_per_second", max_bytes_per_second, 2**64 - 1),
                _whole("max_frame_bytes", max_frame_bytes),
                _seconds("rpc_deadline", rpc_deadline), bool(use_forecast), native_device,
                in_place)
        try:
            self._native = _native.PrefillSession(*args)
        except (TypeError, RuntimeError, OverflowError) as e:
            mapped = native_error("prefill", e)
            if mapped is e:
                raise
            raise mapped from e
        self.plan = kvtier_pb2.PrefillPlan()
        self.plan.ParseFromString(self._native.plan())
        self.call_error: KvTierError | None = None  # See close().

    @property
    def num_keys(self) -> int:
        return self._native.num_keys

    @property
    def stream_reached(self) -> int:
        """Lowest chunk index whose frames started arriving (h before any)."""
        return self._native.stream_reached

    def should_compute(self, i: int) -> bool:
        """Whether the worker should compute chunk i now (see PrefillSession.h)."""
        return self._native.should_compute(_whole("i", i))

    def report_computed(self, i: int) -> None:
        """Chunks [0, i] are computed."""
        self._native.report_computed(_whole("i", i))

    def finish(self) -> PrefillResult:
        """Waits for Done; returns what was streamed and what is left to compute."""
        d = self._native.finish()
        d["reason"] = _reason_name(d["reason"])
        return PrefillResult(**d)

    def close(self) -> None:
        """Ends the call (cancelling it if finish was not called) and joins its thread.

        Once finish() has returned a result, the call's own ending does not change it:
        a daemon that sent Done and then ended the call with an error (UNAVAILABLE after
        Done{SHUTTING_DOWN}, or CANCELLED when the worker took longer than the daemon
        waits to finish) leaves the result standing. close() then raises nothing, and
        ``call_error`` holds that error (None if the call ended OK)."""
        if self._native.calling_back:
            raise FailedPreconditionError(
                "close() called from inside the session's own on_chunk or on_in_place: it "
                "waits for the thread that runs them; call it from the worker's thread")
        try:
            self._native.close()
        except KvTierError as e:
            # Cancelled because finish() was never called: that is what close means then.
            # After finish(), its result stands (its chunks were verified as they came).
            self.call_error = e

    def __enter__(self) -> "PrefillSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
