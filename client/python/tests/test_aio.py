"""kvtier.aio against a real daemon, including a task cancelled mid-get."""

import asyncio
import os
import signal

import numpy as np
import pytest

import kvtier
import kvtier.aio
from conftest import small_layout
from kvtier.testing import Daemon
from test_client import keys_of, payloads, stop_daemon, until_in_flight


def run(coro):
    return asyncio.run(coro)


def test_every_call_as_a_coroutine(daemon):
    async def main():
        async with kvtier.aio.Client(daemon.target) as c:
            lay = small_layout(model_id="pytest-aio")
            ns = (await c.register_layout(lay)).namespace_id
            keys = keys_of(ns, 3, lay, seed=40)
            data = payloads(lay, 3, seed=40)
            assert (await c.put(ns, keys, data, chain_start=0)).stored == 3
            assert (await c.lookup(ns, keys)).prefix_hits == 3
            h = await c.hint("pytest-aio", [(ns, keys)])
            assert (h.requests_accepted, h.keys_accepted, h.cached) == (1, 3, 3)
            assert (await c.hint("pytest-aio", [])).keys_accepted == 0
            out = np.zeros((3, lay.chunk_bytes // 4), np.float32)
            # Concurrent gets share the loop; each fills its own buffer.
            outs = [np.zeros_like(out) for _ in range(4)]
            rs = await asyncio.gather(*(c.get_into(ns, keys, o) for o in outs))
            assert all(r.found == [True] * 3 for r in rs)
            assert all(np.array_equal(o[1], data[1]) for o in outs)
            assert (await c.get(ns, keys[:1]))[0] == data[0].tobytes()
            assert await c.pin(ns, keys, 0) == (3, 0)
            assert await c.unpin(ns, keys) == 3
            assert await c.delete(ns, keys[:1]) == 1
            assert await c.clear(ns) == 2
            assert (await c.stats()).namespaces >= 1
            with pytest.raises(kvtier.NotFoundError):
                await c.lookup(4242, keys)
    run(main())


def test_cancelled_task_mid_get_lets_go_of_the_buffer(tmp_path):
    """A task cancelled while its get waits on the daemon (stopped here, so the get
    cannot finish by itself) ends with CancelledError at once, and afterwards nothing
    writes into its buffer, even once the daemon goes on."""
    big = small_layout(model_id="pytest-aio-big", num_layers=8, num_kv_heads=8, head_dim=128,
                       tokens_per_chunk=256, dtype="bfloat16")  # 8 MiB chunks.
    d = Daemon(str(tmp_path), args=["--ram-capacity=256MiB", "--write-mode=ram-only"])

    async def main():
        # No deadline: only the cancellation can end the get while the daemon is stopped.
        async with kvtier.aio.Client(d.target, max_frame_bytes=256 << 10,
                                     rpc_deadline=0) as c:
            ns = (await c.register_layout(big)).namespace_id
            keys = keys_of(ns, 8, big, seed=41)
            src = np.arange(big.chunk_bytes, dtype=np.uint8)
            await c.put(ns, keys, [src] * 8)
            out = np.zeros(8 * big.chunk_bytes, np.uint8)
            stop_daemon(d.proc.pid)
            try:
                task = asyncio.ensure_future(c.get_into(ns, keys, out))
                await until_in_flight(c, task)  # The native get waits on the daemon.
                task.cancel()
                # Not wait_for: it would wait for a task that ignored the cancel for ever.
                done, _ = await asyncio.wait({task}, timeout=120)
                assert task in done, "the cancelled get did not end while the daemon was stopped"
                with pytest.raises(asyncio.CancelledError):
                    task.result()
                # The native call has ended: the buffer is no longer written. Take a
                # snapshot and check it stays the same once the daemon goes on and the
                # client goes on serving.
                snapshot = out.copy()
            finally:
                os.kill(d.proc.pid, signal.SIGCONT)
            r = await c.get_into(ns, keys[:1], np.zeros(big.chunk_bytes, np.uint8))
            assert r.found == [True]
            assert np.array_equal(out, snapshot)
    try:
        run(main())
    finally:
        d.close()


def test_cancelled_task_still_queued_for_a_thread_ends_at_once(tmp_path):
    """A transfer cancelled while it still waits in the executor's queue (every thread
    held by a get on a stopped daemon, with no deadline) ends at once: it never ran, so
    it holds no buffer. It once waited for a free thread, here for ever."""
    lay = small_layout(model_id="pytest-aio-queued")
    d = Daemon(str(tmp_path), args=["--ram-capacity=64MiB", "--write-mode=ram-only"])

    async def main():
        c = kvtier.aio.Client(d.target, max_workers=1, rpc_deadline=0)
        ns = (await c.register_layout(lay)).namespace_id
        keys = keys_of(ns, 2, lay, seed=43)
        await c.put(ns, keys, payloads(lay, 2, seed=43), chain_start=0)
        stop_daemon(d.proc.pid)
        try:
            holder = asyncio.ensure_future(c.get_into(ns, keys, np.zeros(2 * lay.chunk_bytes,
                                                                         np.uint8)))
            await until_in_flight(c, holder)  # The executor's only thread waits on the daemon.
            queued_out = np.zeros(2 * lay.chunk_bytes, np.uint8)
            queued = asyncio.ensure_future(c.get_into(ns, keys, queued_out))
            for _ in range(100):  # Until the queued call is submitted to the executor.
                if len(c._transfers) == 2:
                    break
                await asyncio.sleep(0)
            assert len(c._transfers) == 2 and not queued.done()
            queued.cancel()
            for _ in range(100):  # Loop turns only: the holder cannot end by itself.
                if queued.done():
                    break
                await asyncio.sleep(0)
            assert queued.done(), "the cancelled queued get waited for the busy thread"
            assert queued.cancelled()
            assert not holder.done()
            assert not queued_out.any()
            holder.cancel()
            done, _ = await asyncio.wait({holder}, timeout=120)
            assert holder in done, "the cancelled in-flight get did not end"
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)
        await c.close()
    try:
        run(main())
    finally:
        d.close()
