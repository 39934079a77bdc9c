"""A request's KV cache <-> kvtier chunk payloads, exactly as the registered layout says.

Chunk payload (proto/kvtier/v1/kvtier.proto, "Payload"): layer-major, layer 0's K then
V, then layer 1's, ... Layer ``l`` of a chunk occupies bytes
``[l * layer_bytes, (l + 1) * layer_bytes)``.

In-layer order (the choice this worker makes, used in both directions): each K block,
then each V block, is a C-contiguous (row-major) array of shape
``[num_kv_heads, tokens_per_chunk, head_dim]`` in the layout's dtype, little-endian:
element ``(head, token, dim)`` of K in layer ``l`` of a chunk sits at byte

    l * layer_bytes + ((head * C + token) * head_dim + dim) * itemsize

and V's at the same offset plus ``layer_bytes / 2``. ``token`` counts from the chunk's
first token. So a buffer of ``n`` chunks is exactly a C-contiguous tensor of shape
``[n, num_layers, 2, num_kv_heads, C, head_dim]`` (``ChunkLayout.alloc``), and chunk ``i``
is bytes ``[i * chunk_bytes, (i + 1) * chunk_bytes)`` of it, which is the single-buffer
form ``Client.get_into`` and ``Client.prefill(dest=...)`` fill.

Views: layer ``l`` of chunk ``i`` (``buf[i, l, 0]`` and ``buf[i, l, 1]``) is a zero-copy
``[num_kv_heads, C, head_dim]`` view. The K of ``n`` consecutive chunks as one
``[num_kv_heads, n * C, head_dim]`` tensor is not a view of this layout (the token axis
is split by chunks); ``layer_kv`` gathers it with one copy per layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple, Union

import torch

KV = Tuple[torch.Tensor, torch.Tensor]

_TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _dtype_of(d) -> torch.dtype:
    if isinstance(d, torch.dtype):
        return d
    name = getattr(d, "name", None)  # kvtier.DType
    if name is not None and not isinstance(d, str):
        d = name.lower()
    d = str(d)
    if d.startswith("torch."):
        d = d[len("torch."):]
    if d not in _TORCH:
        raise ValueError(f"dtype: {d!r} is not float32, bfloat16 or float16")
    return _TORCH[d]


@dataclass(frozen=True)
class ChunkLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tokens_per_chunk: int
    dtype: torch.dtype

    def __post_init__(self):
        object.__setattr__(self, "dtype", _dtype_of(self.dtype))

    @classmethod
    def from_kvtier(cls, layout) -> "ChunkLayout":
        """From a kvtier.Layout."""
        return cls(layout.num_layers, layout.num_kv_heads, layout.head_dim,
                   layout.tokens_per_chunk, _dtype_of(layout.dtype))

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def block_shape(self) -> Tuple[int, int, int]:
        return (self.num_kv_heads, self.tokens_per_chunk, self.head_dim)

    @property
    def chunk_shape(self) -> Tuple[int, ...]:
        return (self.num_layers, 2) + self.block_shape

    @property
    def layer_bytes(self) -> int:
        return 2 * self.num_kv_heads * self.tokens_per_chunk * self.head_dim * self.itemsize

    @property
    def chunk_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    # -- Buffers ---------------------------------------------------------------------

    def alloc(self, num_chunks: int) -> torch.Tensor:
        """A zeroed buffer of ``num_chunks`` chunks: [n, layers, 2, heads, C, head_dim]."""
        return torch.zeros((num_chunks,) + self.chunk_shape, dtype=self.dtype)

    def check_buffer(self, buf: torch.Tensor, name: str = "buffer") -> int:
        """Checks ``buf`` is a C-contiguous CPU chunk buffer of this layout; returns its
        chunk count. Raises TypeError (not a tensor, wrong dtype) or ValueError (device,
        shape, strides). CPU only: kvtier's host path (get_into, put) reads and writes
        host memory, and a buffer it would refuse must be refused here, before a load
        starts."""
        if not isinstance(buf, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(buf).__name__}")
        if buf.device.type != "cpu":
            raise ValueError(f"{name}: tensor is on {buf.device}; chunk buffers are host "
                             "(CPU) memory")
        if buf.dtype != self.dtype:
            raise TypeError(f"{name}: dtype {buf.dtype}, the layout's is {self.dtype}")
        if buf.ndim != 6 or tuple(buf.shape[1:]) != self.chunk_shape:
            raise ValueError(f"{name}: shape {tuple(buf.shape)}, expected "
                             f"[n, {', '.join(map(str, self.chunk_shape))}]")
        if not buf.is_contiguous():
            raise ValueError(f"{name}: not contiguous (strides {tuple(buf.stride())}); chunk "
                             "payloads must be contiguous bytes")
        return buf.shape[0]

    def view_bytes(self, data: Union[bytes, bytearray, memoryview], num_chunks: int = None
                   ) -> torch.Tensor:
        """Zero-copy chunk-buffer view of raw payload bytes (torch.frombuffer): writable
        when ``data`` is (bytearray, writable memoryview); a read-only ``bytes`` is copied
        into a bytearray first (torch cannot view read-only memory safely)."""
        mv = memoryview(data)
        if mv.readonly:
            mv = memoryview(bytearray(mv))
        if mv.nbytes % self.chunk_bytes:
            raise ValueError(f"payload: {mv.nbytes} bytes is not a whole number of "
                             f"{self.chunk_bytes}-byte chunks")
        n = mv.nbytes // self.chunk_bytes
        if num_chunks is not None and n != num_chunks:
            raise ValueError(f"payload: {n} chunks, expected {num_chunks}")
        if n == 0:
            return self.alloc(0)
        return torch.frombuffer(mv.cast("B"), dtype=self.dtype).view((n,) + self.chunk_shape)

    # -- KV <-> chunks ---------------------------------------------------------------

    def _check_kv(self, kv: Sequence[KV], name: str = "kv") -> int:
        if len(kv) != self.num_layers:
            raise ValueError(f"{name}: {len(kv)} layers, the layout has {self.num_layers}")
        tokens = None
        for l, (k, v) in enumerate(kv):
            for which, t in (("K", k), ("V", v)):
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"{name}[{l}] {which}: expected a torch.Tensor")
                if t.dtype != self.dtype:
                    raise TypeError(f"{name}[{l}] {which}: dtype {t.dtype}, the layout's is "
                                    f"{self.dtype}")
                if t.ndim != 3 or t.shape[0] != self.num_kv_heads or t.shape[2] != self.head_dim:
                    raise ValueError(f"{name}[{l}] {which}: shape {tuple(t.shape)}, expected "
                                     f"[{self.num_kv_heads}, tokens, {self.head_dim}]")
                if tokens is None:
                    tokens = t.shape[1]
                elif t.shape[1] != tokens:
                    raise ValueError(f"{name}[{l}] {which}: {t.shape[1]} tokens, expected {tokens}")
        return tokens or 0

    def pack(self, kv: Sequence[KV], num_chunks: int = None, out: torch.Tensor = None
             ) -> torch.Tensor:
        """Cuts per-layer (K, V) [heads, tokens, head_dim] into chunk payloads.

        Packs the first ``num_chunks`` (default: every full chunk) chunks of tokens
        starting at kv's token 0, into ``out`` (a chunk buffer of exactly that many
        chunks) or a new buffer; returns the buffer. A trailing partial chunk is left out.
        """
        tokens = self._check_kv(kv)
        C = self.tokens_per_chunk
        if num_chunks is None:
            num_chunks = tokens // C
        if num_chunks * C > tokens:
            raise ValueError(f"kv: {tokens} tokens, {num_chunks} chunks need {num_chunks * C}")
        if out is None:
            out = torch.empty((num_chunks,) + self.chunk_shape, dtype=self.dtype)
        elif self.check_buffer(out, "out") != num_chunks:
            raise ValueError(f"out: {out.shape[0]} chunks, expected {num_chunks}")
        H, d = self.num_kv_heads, self.head_dim
        for l, (k, v) in enumerate(kv):
            for j, t in enumerate((k, v)):
                # [H, n*C, d] -> [H, n, C, d] -> [n, H, C, d]: copied into out[:, l, j].
                src = t[:, :num_chunks * C].reshape(H, num_chunks, C, d).transpose(0, 1)
                out[:, l, j].copy_(src)
        return out

    def layer_kv(self, buf: torch.Tensor, layer: int, num_chunks: int = None,
                 first_chunk: int = 0) -> KV:
        """(K, V) [heads, n*C, head_dim] of chunks [first_chunk, first_chunk + n) of buf, for
        one layer (one gather copy each)."""
        total = self.check_buffer(buf)
        if num_chunks is None:
            num_chunks = total - first_chunk
        if not 0 <= first_chunk <= first_chunk + num_chunks <= total:
            raise ValueError(f"chunks [{first_chunk}, {first_chunk + num_chunks}) outside the "
                             f"buffer's {total}")
        H, C, d = self.block_shape
        part = buf[first_chunk:first_chunk + num_chunks, layer]  # [n, 2, H, C, d]
        k = part[:, 0].transpose(0, 1).reshape(H, num_chunks * C, d)
        v = part[:, 1].transpose(0, 1).reshape(H, num_chunks * C, d)
        return k, v

    def unpack(self, buf: torch.Tensor, num_chunks: int = None, first_chunk: int = 0
               ) -> List[KV]:
        """Chunk payloads -> per-layer (K, V) [heads, n*C, head_dim] (the inverse of pack)."""
        return [self.layer_kv(buf, l, num_chunks, first_chunk) for l in range(self.num_layers)]

    def chunk_views(self, buf: torch.Tensor, chunk: int) -> List[KV]:
        """Zero-copy per-layer (K, V) [heads, C, head_dim] views of one chunk of buf."""
        self.check_buffer(buf)
        return [(buf[chunk, l, 0], buf[chunk, l, 1]) for l in range(self.num_layers)]

    def layer_byte_range(self, layer: int) -> Tuple[int, int]:
        return layer * self.layer_bytes, (layer + 1) * self.layer_bytes


def as_bytes(t: torch.Tensor) -> memoryview:
    """A flat byte view of a contiguous CPU tensor (no copy)."""
    if not t.is_contiguous():
        raise ValueError("tensor is not contiguous")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())
