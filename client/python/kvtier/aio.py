"""kvtier.aio: the client for engines with an asyncio event loop.

Each coroutine runs the blocking native call on a thread pool (the native layer releases
the GIL, so the loop keeps running). Cancelling a task mid-transfer cancels the call and
then waits for the native side to let go of the caller's buffers before the task's
CancelledError propagates: after ``await`` raises, nothing in ``out`` counts as loaded,
and nothing this client does writes into it any more. One exception: ``out`` in a buffer
from ``client.shared_buffer()`` is written by the daemon itself, which finishes the chunk
copy it is in (a moment, a chunk's memcpy) after the call ended: do not hand such a
buffer to other work the instant a load into it failed or was cancelled.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from typing import Optional, Sequence

from . import _native
from .client import Client as _SyncClient


class Client:
    """Async twin of kvtier.Client: same methods, as coroutines."""

    def __init__(self, target: str, *, max_workers: int = 8, **options):
        self._sync = _SyncClient(target, **options)
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_workers, thread_name_prefix="kvtier-aio")
        self._transfers = set()  # Cancellers of the transfers in flight (loop thread only).

    @property
    def sync(self) -> _SyncClient:
        """The synchronous client underneath (shares the channel)."""
        return self._sync

    async def close(self) -> None:
        """Cancels the transfers in flight and waits for every call to end, off the
        event loop (a call waiting on a stopped daemon ends at its rpc_deadline)."""
        for canceller in list(self._transfers):
            canceller.cancel()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._sync.close)
        await loop.run_in_executor(None, functools.partial(self._executor.shutdown, wait=True))

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _call(self, fn, *args, **kwargs):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    async def _transfer(self, fn, *args, **kwargs):
        """Runs a cancellable transfer: on task cancellation, cancels the native call
        and waits for it to end before re-raising."""
        canceller = _native.Canceller()
        # The concurrent future, not run_in_executor's wrapper: only it can take a call
        # that still waits for a free thread back out of the executor's queue.
        cf = self._executor.submit(functools.partial(fn, *args, _canceller=canceller, **kwargs))
        fut = asyncio.wrap_future(cf)
        self._transfers.add(canceller)
        fut.add_done_callback(lambda _: self._transfers.discard(canceller))
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            canceller.cancel()
            if cf.cancel():
                # Still queued: the call never ran and never will, so nothing touches the
                # buffers. Waiting would mean waiting for a thread that other calls (on a
                # stopped daemon, up to their rpc_deadline or for ever) may hold.
                raise
            while not fut.done():
                try:
                    await asyncio.shield(fut)
                except asyncio.CancelledError:
                    continue  # Cancelled again: still wait for the buffers to be free.
                except BaseException:
                    break
            raise

    async def register_layout(self, layout):
        return await self._call(self._sync.register_layout, layout)

    async def lookup(self, namespace_id: int, keys: Sequence[bytes], lease_seconds: int = 0):
        return await self._call(self._sync.lookup, namespace_id, keys, lease_seconds)

    async def hint(self, client_id: str, requests):
        return await self._call(self._sync.hint, client_id, requests)

    async def release_lease(self, namespace_id: int, lease: int):
        return await self._call(self._sync.release_lease, namespace_id, lease)

    async def put(self, namespace_id: int, keys, buffers, token_counts=None, *,
                  chain_start=None, prev_key=None):
        return await self._transfer(self._sync.put, namespace_id, keys, buffers, token_counts,
                                    chain_start=chain_start, prev_key=prev_key)

    async def get_into(self, namespace_id: int, keys, out, layers=None, order: str = "chunk",
                       on_layer=None, *, lease: int = 0):
        return await self._transfer(self._sync.get_into, namespace_id, keys, out, layers,
                                    order, on_layer, lease=lease)

    async def get(self, namespace_id: int, keys, layers=None, order: str = "chunk", *,
                  lease: int = 0):
        # A transfer like the others: cancelling the task cancels the stream, instead
        # of leaving it to hold an executor thread until its deadline.
        return await self._transfer(self._sync.get, namespace_id, keys, layers, order,
                                    lease=lease)

    async def pin(self, namespace_id: int, keys, ttl_seconds: int = 0):
        return await self._call(self._sync.pin, namespace_id, keys, ttl_seconds)

    async def unpin(self, namespace_id: int, keys):
        return await self._call(self._sync.unpin, namespace_id, keys)

    async def delete(self, namespace_id: int, keys):
        return await self._call(self._sync.delete, namespace_id, keys)

    async def clear(self, namespace_id: int):
        return await self._call(self._sync.clear, namespace_id)

    async def stats(self):
        return await self._call(self._sync.stats)

    def layout(self, namespace_id: int):
        return self._sync.layout(namespace_id)
