"""Layouts, namespaces and chunk keys: the proto's normative encodings, in Python.

These are a second, independent implementation of the scheme in the header of
proto/kvtier/v1/kvtier.proto (the C++ one is storage/chunk_key.cc and
storage/layout_spec.cc). Both pass the vectors in tests/vectors/chunk_keys.json.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Iterable, List, Sequence, Union

import numpy as np
import xxhash

from .errors import InvalidArgumentError


class DType(enum.IntEnum):
    """Element type of the KV tensors (values are kvtier.v1.DType's)."""

    FLOAT16 = 1
    BFLOAT16 = 2
    FLOAT32 = 3
    FLOAT8_E4M3 = 4
    FLOAT8_E5M2 = 5

    @property
    def itemsize(self) -> int:
        return {1: 2, 2: 2, 3: 4, 4: 1, 5: 1}[int(self)]


class KeyPosition(enum.IntEnum):
    """Whether cached K is stored before or after rotary embedding (kvtier.v1.KeyPosition)."""

    POST_ROPE = 1
    PRE_ROPE = 2


class Tier(enum.IntEnum):
    """Where a chunk lives (kvtier.v1.Tier); ABSENT is TIER_UNSPECIFIED."""

    ABSENT = 0
    GPU = 1
    RAM = 2
    SSD = 3
    REMOTE = 4  # The shared tier (Redis Cluster), when the daemon has one.

    @classmethod
    def _missing_(cls, value):
        # A tier a newer daemon added (the proto promises values may be added): kept,
        # as an unnamed member (present, so not ABSENT), instead of failing the call.
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            return None
        member = int.__new__(cls, value)
        member._name_ = f"TIER_{value}"
        member._value_ = value
        return member


_DTYPE_NAMES = {
    "float16": DType.FLOAT16, "fp16": DType.FLOAT16, "half": DType.FLOAT16,
    "bfloat16": DType.BFLOAT16, "bf16": DType.BFLOAT16,
    "float32": DType.FLOAT32, "fp32": DType.FLOAT32, "float": DType.FLOAT32,
    "float8_e4m3": DType.FLOAT8_E4M3, "float8_e4m3fn": DType.FLOAT8_E4M3,
    "float8_e5m2": DType.FLOAT8_E5M2,
}
_KEY_POSITION_NAMES = {"post_rope": KeyPosition.POST_ROPE, "pre_rope": KeyPosition.PRE_ROPE}

_MAX_MODEL_ID_BYTES = 256
_U32 = 0xFFFFFFFF


def _dtype(v) -> DType:
    if isinstance(v, DType):
        return v
    if isinstance(v, int):
        try:
            return DType(v)
        except ValueError:
            raise InvalidArgumentError(f"layout.dtype: {v} is not a kvtier DType") from None
    name = str(v)
    if name.startswith("torch."):
        name = name[len("torch."):]
    if name not in _DTYPE_NAMES:
        raise InvalidArgumentError(
            f"layout.dtype: {v!r} is not one of {sorted(set(_DTYPE_NAMES))}")
    return _DTYPE_NAMES[name]


def _key_position(v) -> KeyPosition:
    if isinstance(v, KeyPosition):
        return v
    if isinstance(v, int):
        try:
            return KeyPosition(v)
        except ValueError:
            raise InvalidArgumentError(f"layout.key_position: {v} is not a KeyPosition") from None
    if str(v) not in _KEY_POSITION_NAMES:
        raise InvalidArgumentError(
            f"layout.key_position: {v!r} is not 'post_rope' or 'pre_rope'")
    return _KEY_POSITION_NAMES[str(v)]


@dataclass(frozen=True)
class Layout:
    """The KV cache of one model shard (kvtier.v1.Layout). Validated on construction.

    ``dtype`` takes a :class:`DType`, its number, a name such as ``"bfloat16"``, or a
    torch dtype; ``key_position`` a :class:`KeyPosition` or ``"post_rope"``/``"pre_rope"``.
    """

    model_id: str
    dtype: Union[DType, str, int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tokens_per_chunk: int
    tp_world_size: int = 1
    tp_rank: int = 0
    key_position: Union[KeyPosition, str, int] = KeyPosition.POST_ROPE
    model_revision: str = ""

    def __post_init__(self):
        object.__setattr__(self, "dtype", _dtype(self.dtype))
        object.__setattr__(self, "key_position", _key_position(self.key_position))
        if not isinstance(self.model_id, str) or not isinstance(self.model_revision, str):
            raise InvalidArgumentError(
                f"layout.model_id and model_revision: must be str, got "
                f"{type(self.model_id).__name__} and {type(self.model_revision).__name__}")
        model = self.model_id.encode("utf-8")
        if not model:
            raise InvalidArgumentError("layout.model_id: must not be empty")
        if len(model) > _MAX_MODEL_ID_BYTES:
            raise InvalidArgumentError(
                f"layout.model_id: {len(model)} bytes, more than {_MAX_MODEL_ID_BYTES}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "tokens_per_chunk",
                     "tp_world_size"):
            v = getattr(self, name)
            # bool is an int to Python; True layers is a mistake, not 1.
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= _U32:
                raise InvalidArgumentError(f"layout.{name}: must be an integer >= 1, got {v!r}")
        if (not isinstance(self.tp_rank, int) or isinstance(self.tp_rank, bool) or
                not 0 <= self.tp_rank < self.tp_world_size):
            raise InvalidArgumentError(
                f"layout.tp_rank: must be in [0, tp_world_size={self.tp_world_size}), "
                f"got {self.tp_rank!r}")

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer of one chunk: K then V, each heads x tokens x head_dim."""
        return 2 * self.num_kv_heads * self.head_dim * self.tokens_per_chunk * self.dtype.itemsize

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one chunk: every layer, layer-major."""
        return self.num_layers * self.layer_bytes

    def canonical_encoding(self) -> bytes:
        """The layout's normative byte encoding (see the proto's "Namespace id")."""
        le32 = lambda v: struct.pack("<I", v)  # noqa: E731
        model = self.model_id.encode("utf-8")
        rev = self.model_revision.encode("utf-8")
        return (b"kvtier-layout-v1" + le32(len(model)) + model + le32(len(rev)) + rev +
                b"".join(le32(int(v)) for v in (
                    self.dtype, self.num_layers, self.num_kv_heads, self.head_dim,
                    self.tokens_per_chunk, self.tp_world_size, self.tp_rank)) +
                bytes([int(self.key_position)]))

    @property
    def namespace_id(self) -> int:
        return namespace_id(self)


def namespace_id(layout: Layout) -> int:
    """XXH3-64 (seed 0) of the layout's canonical encoding."""
    return xxhash.xxh3_64_intdigest(layout.canonical_encoding())


def _tokens_u32(tokens) -> np.ndarray:
    if hasattr(tokens, "detach") and hasattr(tokens, "cpu"):  # a torch tensor
        tokens = tokens.detach().cpu().numpy()
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise InvalidArgumentError(f"tokens: expected a 1-D sequence, got shape {arr.shape}")
    if arr.size == 0:
        return arr.astype("<u4")
    if arr.dtype.kind not in "iu":
        raise InvalidArgumentError(f"tokens: expected integer token ids, got {arr.dtype}")
    if arr.min() < 0 or arr.max() > _U32:
        raise InvalidArgumentError("tokens: token ids must fit unsigned 32 bits")
    return arr.astype("<u4", copy=False)


def chunk_keys(namespace_id: int, tokens: Union[Sequence[int], Iterable[int], np.ndarray],
               tokens_per_chunk: int) -> List[bytes]:
    """The 16-byte keys of the full chunks of ``tokens`` (a partial last chunk gets none).

    key[0] = XXH3_128(le64(namespace_id) || le32 tokens[0:C]);
    key[i] = XXH3_128(key[i-1] || le32 tokens[iC:(i+1)C]), each key in canonical
    (big-endian) form.
    """
    if not isinstance(tokens_per_chunk, int) or tokens_per_chunk < 1:
        raise InvalidArgumentError(f"tokens_per_chunk: must be >= 1, got {tokens_per_chunk!r}")
    if not 0 <= namespace_id <= 0xFFFFFFFFFFFFFFFF:
        raise InvalidArgumentError("namespace_id: must fit unsigned 64 bits")
    data = _tokens_u32(tokens).tobytes()
    step = 4 * tokens_per_chunk
    n = len(data) // step
    keys: List[bytes] = []
    prev = struct.pack("<Q", namespace_id)
    for i in range(n):
        prev = xxhash.xxh3_128_digest(prev + data[i * step:(i + 1) * step])
        keys.append(prev)
    return keys
