"""kvtier.Client: the synchronous client (a binding of the C++ client, kvtier._native)."""

from __future__ import annotations

import operator
import os
import threading
import weakref
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

from . import _native
from ._buffers import byte_view
from ._layout import Layout, Tier
from .errors import CancelledError, FailedPreconditionError, InvalidArgumentError, KvTierError
from .v1 import kvtier_pb2

LayerRange = Tuple[int, int]
_ORDERS = {"chunk": 0, "layer": 1}


# gRPC does not survive fork: the child has none of the threads it relies on (timers,
# connection set-up), so a call there hangs past any deadline, and an inherited
# connection's socket is the parent's too. The process whose clients use gRPC; a client
# made or used in a process forked from it is refused instead.
_grpc_pid: Optional[int] = None


def _check_process(what: str) -> None:
    global _grpc_pid
    pid = os.getpid()
    if _grpc_pid is None:
        _grpc_pid = pid
    elif _grpc_pid != pid:
        raise FailedPreconditionError(
            f"{what}: this process ({pid}) was forked from process {_grpc_pid}, which had "
            "already used kvtier, and gRPC does not survive fork. Start workers with the "
            "'spawn' or 'forkserver' method, or make the first kvtier client after forking")


def native_error(name: str, e: Exception) -> Exception:
    """pybind11's refusal of a call's arguments (a negative or too large int, None, a wrong
    type) as InvalidArgumentError, as errors.py promises; `e` itself otherwise (an error
    a callback of the caller's raised inside the call, on_layer or progress)."""
    text = str(e)
    if isinstance(e, (TypeError, RuntimeError, OverflowError)) and (
            "incompatible function arguments" in text or "Unable to cast" in text
            or "incompatible constructor arguments" in text
            or isinstance(e, OverflowError)):
        return InvalidArgumentError(f"{name}: {text}")
    return e


class _Native:
    """The native client, its argument errors raised as InvalidArgumentError
    (native_error) and refused in a forked child (_check_process). The native calls' own
    errors are KvTierErrors already and pass through."""

    def __init__(self, native):
        object.__setattr__(self, "_n", native)

    def raw(self, what: str):
        """The native client, for a native object that takes it (a prefill session)."""
        _check_process(what)
        return self._n

    def __getattr__(self, name):
        # Before getattr: a native property may itself call the daemon (data_path
        # decides the data plane, a DataPlane RPC), which hangs in a forked child.
        _check_process(name)
        attr = getattr(self._n, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            _check_process(name)
            try:
                return attr(*args, **kwargs)
            except (TypeError, RuntimeError, OverflowError) as e:
                mapped = native_error(name, e)
                if mapped is e:
                    raise
                raise mapped from e
        return call


def _seconds(name: str, value) -> float:
    """A duration argument: a number of seconds >= 0 (inf allowed; not NaN, not a bool)."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = float("nan")
    if isinstance(value, bool) or not seconds >= 0:
        raise InvalidArgumentError(f"{name}: must be a number of seconds >= 0, got {value!r}")
    return seconds


def _whole(name: str, value, upper: int = (1 << 32) - 1) -> int:
    """A count argument: an int in [0, upper] (numpy ints and whole floats too; not a
    bool, not 1.5)."""
    n = None
    if not isinstance(value, bool):
        if isinstance(value, float) and value.is_integer():
            n = int(value)
        else:
            try:
                n = operator.index(value)
            except TypeError:
                n = None
    if n is None or not 0 <= n <= upper:
        raise InvalidArgumentError(f"{name}: must be an integer in [0, {upper}], got {value!r}")
    return n


@dataclass(frozen=True)
class RegisterResult:
    namespace_id: int
    chunk_bytes: int
    already_registered: bool


@dataclass(frozen=True)
class LookupResult:
    tiers: List[Tier]   # One per key; Tier.ABSENT where absent.
    prefix_hits: int    # Leading keys present: the chunks a request can reuse.
    lease: int = 0      # The lease on the hits (lookup(lease_seconds=...)); 0: none.


@dataclass(frozen=True)
class PutResult:
    stored: int           # Chunks newly stored.
    already_present: int  # Chunks the daemon already had (puts are idempotent).
    bytes: int            # Payload bytes the daemon received.


@dataclass(frozen=True)
class GetResult:
    found: List[bool]        # Per key; an absent key's slice of `out` is left untouched.
    tiers: List[Tier]        # Tier each found chunk was read from.
    token_counts: List[int]  # As given at put.
    bytes: int               # Payload bytes received.

    @property
    def prefix_found(self) -> int:
        """Leading keys found: how many chunks of the request's prefix were loaded."""
        n = 0
        for f in self.found:
            if not f:
                break
            n += 1
        return n


@dataclass(frozen=True)
class DeviceRegion:
    """GPU memory of this process registered with a same-host daemon that drives a GPU
    (Client.register_device_memory). get_into_device() copies chunks straight into it
    on the daemon's CUDA streams."""
    region_id: int
    token: int
    nbytes: int


def _check_chain_start(chain_start: Optional[int], keys: int) -> None:
    if chain_start is not None and not 0 <= _whole("chain_start", chain_start) <= 2**32 - 2 - keys:
        raise InvalidArgumentError(
            f"chain_start: {chain_start} is not a chunk index (0 to 2**32 - 2, "
            f"with room for {keys} keys)")


def _order(order: str) -> int:
    if order not in _ORDERS:
        raise InvalidArgumentError(f"order: {order!r} is not 'chunk' or 'layer'")
    return _ORDERS[order]


def _layers(layers: Optional[LayerRange]) -> Optional[LayerRange]:
    if layers is None:
        return None
    try:
        begin, end = (int(v) for v in layers)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"layers: expected (begin, end), got {layers!r}") from None
    if not 0 <= begin < end:
        raise InvalidArgumentError(f"layers: [{begin}, {end}) is not a non-empty range")
    return (begin, end)


def _keys(keys: Sequence[bytes], name: str = "keys") -> List[bytes]:
    if isinstance(keys, (bytes, bytearray)):
        raise InvalidArgumentError(f"{name}: expected a sequence of 16-byte keys, got one bytes")
    try:
        return [bytes(k) if isinstance(k, (bytearray, memoryview)) else k for k in keys]
    except TypeError as e:
        raise InvalidArgumentError(
            f"{name}: expected a sequence of 16-byte keys, got {type(keys).__name__}") from e


def _checked_keys(keys: Sequence[bytes]) -> List[bytes]:
    """_keys, each checked as the native layer checks it (bytes, 16 of them), for a call
    that would otherwise meet a bad key only on its own thread."""
    keys = _keys(keys)
    for i, k in enumerate(keys):
        if not isinstance(k, bytes):
            raise InvalidArgumentError(
                f"keys[{i}]: expected bytes (a 16-byte chunk key), got {type(k).__name__}")
        if len(k) != 16:
            raise InvalidArgumentError(f"keys[{i}]: key must be 16 bytes, got {len(k)}")
    return keys


class Client:
    """A connection to kvtierd. Thread-safe; every call releases the GIL while it waits.

    ``target`` is a gRPC target ("127.0.0.1:50051", "unix:/run/kvtier.sock").
    ``rpc_deadline`` (seconds, 0 for none) bounds each call, a whole transfer included.
    ``connect_timeout`` > 0 waits that long for the daemon at construction and raises
    UnavailableError if it is not there; 0 connects lazily.
    ``tls_ca_file`` turns on TLS, trusting those CA certificates (PEM) for the daemon;
    ``tls_cert_file`` and ``tls_key_file`` add a client certificate (mutual TLS);
    ``tls_server_name`` overrides the name checked in the daemon's certificate.
    ``token`` is sent as a bearer token on every call (a daemon with a tenants file).
    ``malloc_top_pad_bytes``: the first client tunes this process's malloc so that gRPC's
    receive buffers stay mapped between frames (C++ ``ClientOptions``, same name; the
    README's "Using it" says what it changes); 0 leaves the allocator alone.
    ``malloc_arena_max`` > 0 also caps this process's malloc arenas, with the pad only, and
    only the first client's value counts; glibc ignores it in a process that already has
    more than 8 arenas (C++ ``ClientOptions``, same name, says more).
    """

    def __init__(self, target: str, *, max_frame_bytes: int = 4 << 20,
                 rpc_deadline: float = 60.0, connect_timeout: float = 0.0,
                 receive_window_bytes: int = 8 << 20, tls_ca_file: str = "",
                 tls_cert_file: str = "", tls_key_file: str = "", tls_server_name: str = "",
                 token: str = "", malloc_top_pad_bytes: int = 16 << 20,
                 malloc_arena_max: int = 0):
        _seconds("rpc_deadline", rpc_deadline)
        _seconds("connect_timeout", connect_timeout)
        _check_process("Client")
        try:
            native = _native.Client(target, max_frame_bytes, rpc_deadline, connect_timeout,
                                    receive_window_bytes, tls_ca_file, tls_cert_file,
                                    tls_key_file, tls_server_name, token,
                                    malloc_top_pad_bytes, malloc_arena_max)
        except (TypeError, OverflowError) as e:
            raise InvalidArgumentError(f"Client: {e}") from e
        self._native = _Native(native)
        self._layouts: Dict[int, Layout] = {}
        self._lock = threading.Lock()
        # Background loads, for close(). Weak, so that a finished handle the caller
        # dropped goes at once, and with it its reference to this client (a running
        # load's thread holds its handle).
        self._handles: "weakref.WeakSet[LoadHandle]" = weakref.WeakSet()

    @property
    def data_path(self) -> str:
        """How chunk bytes travel: "shared memory (...)" when the daemon is on this host
        and admits this process, else "stream (gRPC): <why>". Decided at first use."""
        return self._native.data_path

    def shared_buffer(self, nbytes: int):
        """Memory shared with a same-host daemon (a writable buffer: wrap it with
        memoryview, numpy.frombuffer or torch.frombuffer). put() from it and get_into()
        it move each byte once; other buffers are staged through shared memory
        automatically. Raises FailedPreconditionError when the data path is the stream."""
        return self._native.shared_buffer(nbytes)

    def register_device_memory(self, ipc_handle: bytes, nbytes: int,
                               event_handles: Sequence[bytes] = ()) -> DeviceRegion:
        """Registers ``nbytes`` of this process's GPU memory, from the start of the
        allocation whose CUDA IPC handle is ``ipc_handle`` (the 64 bytes of
        cudaIpcGetMemHandle; with PyTorch, a tensor's storage handle). The daemon opens
        it in its own CUDA context and checks ``nbytes`` against the allocation.
        Raises FailedPreconditionError when the daemon is on another host or has no
        GPU, InvalidArgumentError for a stale or foreign handle or too small an
        allocation. The registration lasts until release_device_memory() or until this
        client's process exits. ``event_handles`` (at most 512; with PyTorch,
        ``torch.cuda.Event(interprocess=True).ipc_handle()``) are events the daemon
        records for get_into_device(record_events=True); a stale or foreign one raises
        InvalidArgumentError."""
        region_id, token, n = self._native.register_device_memory(
            bytes(ipc_handle), nbytes, [bytes(h) for h in event_handles])
        return DeviceRegion(region_id, token, n)

    def release_device_memory(self, region: DeviceRegion) -> None:
        """Forgets a registration. The daemon refuses while a call still uses the region;
        this waits up to 5 s for such calls to end, then raises FailedPreconditionError.
        Once it returns, the daemon will not touch that memory again."""
        self._native.release_device_memory(region.region_id)

    def put_from_device(self, namespace_id: int, keys: Sequence[bytes], region: DeviceRegion,
                        offsets: Sequence[int], crc32cs: Sequence[int],
                        token_counts: Optional[Sequence[int]] = None, *,
                        chain_start: Optional[int] = None,
                        prev_key: Optional[bytes] = None) -> PutResult:
        """Stores one chunk per key from registered GPU memory: key i's chunk is
        ``region[offsets[i], offsets[i] + chunk_bytes)``. No byte passes through this
        process: the daemon copies each chunk into its pool on its CUDA streams and
        stores it only if that copy's CRC32C is ``crc32cs[i]`` (computed on the GPU, or
        kept from the get that loaded the chunk), so a chunk still being written is never
        stored. ``token_counts``, ``chain_start`` and ``prev_key`` as put(). Raises
        InvalidArgumentError for a chunk outside the region or a CRC32C the bytes do not
        have, FailedPreconditionError when the daemon has no GPU or does not know the
        region. ``bytes`` in the result counts the chunks' bytes the daemon copied."""
        keys = _keys(keys)
        counts = None if token_counts is None else [
            _whole(f"token_counts[{i}]", c) for i, c in enumerate(token_counts)]
        _check_chain_start(chain_start, len(keys))
        stored, present, nbytes = self._native.put_from_device(
            namespace_id, keys, region.region_id, region.token, region.nbytes,
            [int(o) for o in offsets], [int(c) for c in crc32cs], counts,
            None if chain_start is None else int(chain_start),
            None if prev_key is None else bytes(prev_key))
        return PutResult(stored, present, nbytes)

    def get_into_device(self, namespace_id: int, keys: Sequence[bytes], region: DeviceRegion,
                        offset: int = 0, layers: Optional[LayerRange] = None,
                        order: str = "chunk",
                        on_layer: Optional[Callable[[int], None]] = None, *,
                        lease: int = 0, record_events: bool = False) -> GetResult:
        """Loads ``keys`` into registered GPU memory: key i's bytes (the chunk, or
        ``layers`` of it) at ``offset + i * bytes per key`` of ``region``. The daemon
        copies device-to-device from its staging buffers or host-to-device from its
        pinned pool, checking each chunk's CRC32C, and reports each key (or each layer
        with ``order="layer"``, where ``on_layer(l)`` runs once layer ``l`` of every
        found key has landed) only when its bytes are there. ``bytes`` in the result is
        0: the bytes never pass through this process.

        ``record_events`` (a region registered with event handles): each item is
        reported as soon as its copies are queued on the daemon's stream, and the
        region's event number item is recorded after them (item: the key's index, or
        ``(l - layers.begin) * len(keys) + key`` with ``order="layer"``). Make the
        stream that reads the bytes wait on that event (``stream.wait_event``) instead
        of waiting here; write nothing there before the call returns (the daemon may
        still be checking what landed), and use nothing unless it returns: its verdict
        covers every item. One such call per region at a time (AbortedError otherwise)."""
        keys = _keys(keys)
        layers = _layers(layers)
        o = _order(order)
        if on_layer is not None and o != 1:
            raise InvalidArgumentError("on_layer: only with order='layer'")
        found, tiers, tokens, nbytes = self._native.get_into_device(
            namespace_id, keys, region.region_id, region.token, offset, layers, o, on_layer,
            lease, None, bool(record_events))
        return GetResult(list(found), [Tier(t) for t in tiers], list(tokens), nbytes)

    @property
    def target(self) -> str:
        return self._native.target

    def close(self) -> None:
        """Cancels background loads still running and waits for them."""
        with self._lock:
            handles, self._handles = list(self._handles), weakref.WeakSet()
        for h in handles:
            h.cancel()
            h._thread.join()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- Control ---------------------------------------------------------------------

    def register_layout(self, layout: Layout) -> RegisterResult:
        """Registers ``layout`` (idempotent); checks the daemon agrees on id and size."""
        if not isinstance(layout, Layout):
            raise InvalidArgumentError(f"layout: expected kvtier.Layout, got {type(layout).__name__}")
        ns, chunk_bytes, already = self._native.register_layout(
            layout.model_id, layout.model_revision, int(layout.dtype), layout.num_layers,
            layout.num_kv_heads, layout.head_dim, layout.tokens_per_chunk,
            layout.tp_world_size, layout.tp_rank, int(layout.key_position))
        with self._lock:
            self._layouts[ns] = layout
        return RegisterResult(ns, chunk_bytes, already)

    def layout(self, namespace_id: int) -> Optional[Layout]:
        """The layout registered through this client for ``namespace_id``, if any."""
        with self._lock:
            return self._layouts.get(namespace_id)

    def lookup(self, namespace_id: int, keys: Sequence[bytes],
               lease_seconds: int = 0) -> LookupResult:
        """Where each key lives and the prefix hit length. ``lease_seconds`` > 0 asks the
        daemon to hold the hits that are in RAM until the get that passes ``lease=``
        ends, release_lease, or expiry; ``result.lease`` is 0 when it granted none (no
        hits, or it holds as many leases as it allows): the answer then is not held."""
        lease_seconds = _whole("lease_seconds", lease_seconds)
        tiers, hits, lease = self._native.lookup(namespace_id, _keys(keys), lease_seconds)
        return LookupResult([Tier(t) for t in tiers], hits, lease)

    def release_lease(self, namespace_id: int, lease: int) -> bool:
        """Ends a lookup lease without a get. Returns whether there was one to end."""
        return self._native.release_lease(namespace_id, lease)

    def pin(self, namespace_id: int, keys: Sequence[bytes], ttl_seconds: int = 0) -> Tuple[int, int]:
        """Pins keys in RAM (0: until unpin). Returns (pinned, not_found)."""
        return tuple(self._native.pin(namespace_id, _keys(keys), ttl_seconds))

    def unpin(self, namespace_id: int, keys: Sequence[bytes]) -> int:
        return self._native.unpin(namespace_id, _keys(keys))

    def delete(self, namespace_id: int, keys: Sequence[bytes]) -> int:
        return self._native.delete(namespace_id, _keys(keys))

    def clear(self, namespace_id: int) -> int:
        return self._native.clear(namespace_id)

    def hint(self, client_id: str, requests) -> "kvtier_pb2.HintResponse":
        """Tells the daemon what this scheduler runs next: ``requests`` is its queue in
        order, each a ``(namespace_id, keys)`` pair with the request's keys from chunk 0.
        Replaces this ``client_id``'s previous hint (an empty list withdraws it). The
        daemon prefetches the window from SSD into RAM and evicts it last; the answer
        says how much it took (``truncated`` when it cut the hint)."""
        reqs = []
        for i, r in enumerate(requests):
            try:
                ns, keys = r
            except (TypeError, ValueError) as e:
                raise InvalidArgumentError(
                    f"requests[{i}]: expected a (namespace_id, keys) pair, got {r!r}") from e
            reqs.append((_whole(f"requests[{i}] namespace_id", ns, 2**64 - 1),
                         _keys(keys, f"requests[{i}] keys")))
        resp = kvtier_pb2.HintResponse()
        resp.ParseFromString(self._native.hint(str(client_id), reqs))
        return resp

    def stats(self) -> "kvtier_pb2.StatsResponse":
        resp = kvtier_pb2.StatsResponse()
        resp.ParseFromString(self._native.stats())
        return resp

    # -- Data ------------------------------------------------------------------------

    def put(self, namespace_id: int, keys: Sequence[bytes], buffers: Sequence,
            token_counts: Optional[Sequence[int]] = None, *,
            chain_start: Optional[int] = None, prev_key: Optional[bytes] = None,
            _canceller=None) -> PutResult:
        """Stores one chunk per key from ``buffers`` (each exactly chunk_bytes), in one
        stream, straight from the caller's memory. Chunks completed before an error stay
        stored.

        ``chain_start``: the keys are consecutive keys of one request, ``keys[0]`` being
        its chunk ``chain_start``; the daemon's eviction then knows each chunk's position
        and parent (chains are evicted from their tails). ``prev_key`` is the key of chunk
        ``chain_start - 1`` when the put does not start at chunk 0."""
        keys = _keys(keys)
        layout = self.layout(namespace_id)
        dtype = layout.dtype if layout else None
        if not hasattr(buffers, "__len__"):
            raise InvalidArgumentError(
                f"buffers: expected a sequence of buffers, got {type(buffers).__name__}")
        if len(buffers) != len(keys):
            raise InvalidArgumentError(
                f"buffers: {len(buffers)} buffers for {len(keys)} keys; pass one per key")
        views = [byte_view(b, f"buffers[{i}]", writable=False, dtype=dtype)
                 for i, b in enumerate(buffers)]
        if layout is not None:
            for i, v in enumerate(views):
                if v.nbytes != layout.chunk_bytes:
                    raise InvalidArgumentError(
                        f"buffers[{i}]: {v.nbytes} bytes; a chunk of this layout is "
                        f"{layout.chunk_bytes}")
        counts = None if token_counts is None else [
            _whole(f"token_counts[{i}]", c) for i, c in enumerate(token_counts)]
        _check_chain_start(chain_start, len(keys))
        stored, present, nbytes = self._native.put(
            namespace_id, keys, views, counts,
            None if chain_start is None else int(chain_start),
            None if prev_key is None else bytes(prev_key), _canceller)
        return PutResult(stored, present, nbytes)

    def _bytes_per_key(self, namespace_id: int, layers: Optional[LayerRange]) -> Optional[int]:
        layout = self.layout(namespace_id)
        if layout is None:
            return None
        if layers is None:
            return layout.chunk_bytes
        return (layers[1] - layers[0]) * layout.layer_bytes

    def _outs(self, namespace_id, keys, out, layers) -> List[memoryview]:
        layout = self.layout(namespace_id)
        dtype = layout.dtype if layout else None
        per_key = self._bytes_per_key(namespace_id, layers)
        if isinstance(out, (list, tuple)):
            if len(out) != len(keys):
                raise InvalidArgumentError(
                    f"out: {len(out)} buffers for {len(keys)} keys; pass one per key")
            views = [byte_view(b, f"out[{i}]", writable=True, dtype=dtype)
                     for i, b in enumerate(out)]
            if per_key is not None:
                for i, v in enumerate(views):
                    if v.nbytes != per_key:
                        raise InvalidArgumentError(
                            f"out[{i}]: {v.nbytes} bytes; each key needs {per_key}")
            return views
        view = byte_view(out, "out", writable=True, dtype=dtype)
        if per_key is None:
            if not keys:
                return []
            if view.nbytes % len(keys):
                raise InvalidArgumentError(
                    f"out: {view.nbytes} bytes do not split evenly over {len(keys)} keys")
            per_key = view.nbytes // len(keys)
        elif view.nbytes != per_key * len(keys):
            raise InvalidArgumentError(
                f"out: {view.nbytes} bytes; {len(keys)} keys need {per_key * len(keys)} "
                f"({per_key} each)")
        return [view[i * per_key:(i + 1) * per_key] for i in range(len(keys))]

    def get_into(self, namespace_id: int, keys: Sequence[bytes], out,
                 layers: Optional[LayerRange] = None, order: str = "chunk",
                 on_layer: Optional[Callable[[int], None]] = None, *, lease: int = 0,
                 _canceller=None) -> GetResult:
        """Loads ``keys`` into ``out`` with one copy, from gRPC's buffers into yours.

        ``out`` is one writable buffer per key, or one buffer of len(keys) x bytes per
        key (the chunk, or ``layers=(begin, end)`` of it). ``order="layer"`` streams
        layer by layer (layer ``begin`` of every chunk first) and calls
        ``on_layer(l)`` once layer ``l`` of every found chunk has landed. Whole chunks
        are CRC32C-checked; the call returns only when every byte is in and checked.
        When ``out`` is one span of a ``shared_buffer()``, the daemon writes into it
        directly (one copy) and may already be writing later layers while
        ``on_layer(l)`` runs; elsewhere the bytes come through the stream or staging.
        If it raises, treat every buffer as garbage: nothing counts as loaded.
        ``lease``: from lookup(lease_seconds=...); held until this call ends, then over.
        """
        keys = _keys(keys)
        layers = _layers(layers)
        o = _order(order)
        if on_layer is not None and o != 1:
            raise InvalidArgumentError("on_layer: only with order='layer'")
        outs = self._outs(namespace_id, keys, out, layers)
        found, tiers, tokens, nbytes = self._native.get_into(
            namespace_id, keys, outs, layers, o, on_layer, lease, _canceller)
        return GetResult(list(found), [Tier(t) for t in tiers], list(tokens), nbytes)

    def get(self, namespace_id: int, keys: Sequence[bytes],
            layers: Optional[LayerRange] = None, order: str = "chunk", *,
            lease: int = 0, _canceller=None) -> List[Optional[bytes]]:
        """Loads ``keys`` into new bytes objects: one per key, None where absent."""
        keys = _keys(keys)
        return self._native.get(namespace_id, keys, _layers(layers), _order(order), lease,
                                _canceller)

    def start_get_into(self, namespace_id: int, keys: Sequence[bytes], out,
                       layers: Optional[LayerRange] = None,
                       order: str = "layer", *, lease: int = 0) -> "LoadHandle":
        """Starts get_into on a background thread; returns a handle to wait on per layer
        (layer-major) or for the whole load. Arguments are checked before it starts."""
        namespace_id = _whole("namespace_id", namespace_id, 2**64 - 1)
        keys = _checked_keys(keys)
        lease = _whole("lease", lease, 2**64 - 1)
        layers = _layers(layers)
        _order(order)
        outs = self._outs(namespace_id, keys, out, layers)
        layout = self.layout(namespace_id)
        if layers is not None:
            first, end = layers
        elif layout is not None:
            first, end = 0, layout.num_layers
        else:
            first, end = 0, None
        handle = LoadHandle(self, namespace_id, keys, outs, layers, order, first, end, lease)
        with self._lock:
            # Started, then listed, under the lock: close() must not find it listed and
            # not started (joining it would raise, and the handles after it would be left
            # running), nor miss it.
            handle._thread.start()
            self._handles.add(handle)
        return handle

    # -- Prefill (Cake) --------------------------------------------------------------

    def prefill(self, namespace_id: int, keys: Sequence[bytes], *, dest=None,
                on_chunk: Optional[Callable[[int, bytes, Tier], None]] = None,
                device_dest: Optional[Tuple[DeviceRegion, int]] = None,
                on_in_place: Optional[Callable[[int, Tier], None]] = None,
                compute_estimate: Optional[Tuple[float, float]] = None,
                max_bytes_per_second: int = 0, max_frame_bytes: int = 0,
                rpc_deadline: float = 0.0, use_forecast: bool = True) -> "PrefillSession":
        """Opens a Cake prefill session (see kvtier.PrefillSession). Streamed chunks go
        to ``dest`` (a buffer), to ``on_chunk``, or with ``device_dest=(region, offset)``
        into registered GPU memory (chunk i at ``offset + i * chunk_bytes``), copied by
        the daemon on its CUDA streams; ``on_in_place(i, tier)`` then runs once chunk i's
        bytes have landed."""
        from .prefill import PrefillSession
        return PrefillSession(self, namespace_id, _keys(keys), dest=dest, on_chunk=on_chunk,
                              device_dest=device_dest, on_in_place=on_in_place,
                              compute_estimate=compute_estimate,
                              max_bytes_per_second=max_bytes_per_second,
                              max_frame_bytes=max_frame_bytes, rpc_deadline=rpc_deadline,
                              use_forecast=use_forecast)


class LoadHandle:
    """A get_into running on a background thread (Client.start_get_into).

    wait_layer(l) returns once layer l of every found chunk has landed (layer-major
    order; in chunk order it waits for the whole load); wait() returns the GetResult.
    Both raise the load's error if it failed. Landed layers are usable for compute at
    once, but whole-chunk checksums are verified only once whole chunks are in (in
    layer-major order, every chunk's when the stream ends): commit nothing computed
    from the load until wait() has returned. The handle holds the output buffers only
    while the load runs.
    """

    def __init__(self, client: Client, namespace_id, keys, outs, layers, order, first, end,
                 lease=0):
        self._client = client
        self._lease = lease
        self._args = (namespace_id, keys, outs, layers, order)
        self._first = first
        self._end = end
        self._cond = threading.Condition()
        self._layers_done = first  # Layers [first, _layers_done) have landed.
        self._result: Optional[GetResult] = None
        self._error: Optional[BaseException] = None
        self._finished = False
        self._canceller = _native.Canceller()
        self._thread = threading.Thread(target=self._run, name="kvtier-load", daemon=True)

    def _on_layer(self, layer: int) -> None:
        with self._cond:
            self._layers_done = layer + 1
            self._cond.notify_all()

    def _run(self) -> None:
        try:
            result = self._load()
        except BaseException as e:  # Handed to whoever waits.
            with self._cond:
                self._error = e
                self._finished = True
                self._cond.notify_all()
            return
        with self._cond:
            self._result = result
            self._finished = True
            if self._end is not None:
                self._layers_done = self._end
            self._cond.notify_all()

    def _load(self) -> GetResult:
        ns, keys, outs, layers, order = self._args
        try:
            return self._client.get_into(
                ns, keys, outs, layers, order,
                on_layer=self._on_layer if order == "layer" else None,
                lease=self._lease, _canceller=self._canceller)
        finally:
            # The caller's buffers are held only while the load runs: once waiters hear
            # it ended, the handle no longer holds them (a failed load's error, through
            # its traceback, may until the handle goes).
            self._args = None

    def done(self) -> bool:
        with self._cond:
            return self._finished

    def cancel(self) -> None:
        """Asks the load to stop; wait() then raises CancelledError (unless it finished).
        Into a buffer from shared_buffer(), the daemon may finish the chunk copy it is in
        just after wait() raised (see kvtier.aio)."""
        self._canceller.cancel()

    def wait_layer(self, layer: int, timeout: Optional[float] = None) -> None:
        """Blocks until ``layer`` has landed. Raises InvalidArgumentError for a layer the
        load does not fetch (outside its layer range, or the layout's layers), the load's
        error, or TimeoutError."""
        layer = _whole("layer", layer)
        if layer < self._first or (self._end is not None and layer >= self._end):
            raise InvalidArgumentError(
                f"layer: {layer} is not among the load's layers [{self._first}, {self._end})")
        with self._cond:
            ok = self._cond.wait_for(
                lambda: self._error is not None or self._finished or self._layers_done > layer,
                timeout)
            if not ok:
                raise TimeoutError(f"layer {layer} did not land within {timeout} s")
            if self._error is not None:
                raise self._error
            # Finished without error: every layer is in.

    def wait(self, timeout: Optional[float] = None) -> GetResult:
        with self._cond:
            if not self._cond.wait_for(lambda: self._finished, timeout):
                raise TimeoutError(f"the load did not finish within {timeout} s")
            if self._error is not None:
                raise self._error
            return self._result
