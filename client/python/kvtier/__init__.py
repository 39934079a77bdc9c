"""kvtier: the Python client of kvtierd, the KV-cache server for LLM inference.

    import kvtier
    layout = kvtier.Layout("my-model", dtype="bfloat16", num_layers=32, num_kv_heads=8,
                           head_dim=128, tokens_per_chunk=256)
    client = kvtier.Client("127.0.0.1:50051")
    ns = client.register_layout(layout).namespace_id
    keys = kvtier.chunk_keys(ns, prompt_tokens, layout.tokens_per_chunk)
    hits = client.lookup(ns, keys).prefix_hits
    client.get_into(ns, keys[:hits], kv_buffer)          # load the cached prefix
    client.put(ns, keys[hits:], new_chunks)              # store what was computed

The wire contract is proto/kvtier/v1/kvtier.proto; kvtier.v1.kvtier_pb2 has its messages.
"""

from ._layout import DType, KeyPosition, Layout, Tier, chunk_keys, namespace_id
from .client import (Client, DeviceRegion, GetResult, LoadHandle, LookupResult, PutResult,
                     RegisterResult)
from .errors import (AbortedError, CancelledError, DataLossError, DeadlineExceededError,
                     FailedPreconditionError, InternalError, InvalidArgumentError,
                     KvTierError, NotFoundError, PermissionDeniedError,
                     ResourceExhaustedError, UnauthenticatedError, UnavailableError,
                     UnimplementedError)
from .prefill import PrefillResult, PrefillSession
from . import _native


def crc32c(data, crc: int = 0) -> int:
    """CRC32C (Castagnoli) of a buffer, extending ``crc``: the checksum kvtier stores."""
    return _native.crc32c(data, crc)


__all__ = [
    "AbortedError", "CancelledError", "Client", "DType", "DataLossError", "DeviceRegion",
    "DeadlineExceededError", "FailedPreconditionError", "GetResult", "InternalError",
    "InvalidArgumentError", "KeyPosition", "KvTierError", "Layout", "LoadHandle",
    "LookupResult", "NotFoundError", "PermissionDeniedError", "PrefillResult", "PrefillSession", "PutResult",
    "RegisterResult", "ResourceExhaustedError", "Tier", "UnauthenticatedError",
    "UnavailableError",
    "UnimplementedError", "chunk_keys", "crc32c", "namespace_id",
]
__version__ = "0.1.0"
