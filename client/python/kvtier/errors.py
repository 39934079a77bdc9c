"""Typed exceptions of the kvtier client.

Every error a call raises is a :class:`KvTierError` carrying the gRPC status ``code``
(its name, e.g. ``"UNAVAILABLE"``), the daemon's or client's ``message`` (which names
the bad field or key), ``retryable`` and ``advice`` (what the caller should do, from the
status-code contract in proto/kvtier/v1/kvtier.proto). Catch the subclass for the code
you handle; catch ``KvTierError`` for the rest.
"""

from __future__ import annotations

# absl / gRPC status code numbers (the two agree).
_CODE_NAMES = {
    0: "OK", 1: "CANCELLED", 2: "UNKNOWN", 3: "INVALID_ARGUMENT", 4: "DEADLINE_EXCEEDED",
    5: "NOT_FOUND", 6: "ALREADY_EXISTS", 7: "PERMISSION_DENIED", 8: "RESOURCE_EXHAUSTED",
    9: "FAILED_PRECONDITION", 10: "ABORTED", 11: "OUT_OF_RANGE", 12: "UNIMPLEMENTED",
    13: "INTERNAL", 14: "UNAVAILABLE", 15: "DATA_LOSS", 16: "UNAUTHENTICATED",
}


class KvTierError(Exception):
    """A failed kvtier call."""

    code = "UNKNOWN"
    retryable = False
    advice = "see the message"

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return f"{self.code}: {self.message} ({self.advice})"


class InvalidArgumentError(KvTierError, ValueError):
    code = "INVALID_ARGUMENT"
    advice = "the request is malformed; fix the named field, do not retry"


class NotFoundError(KvTierError):
    code = "NOT_FOUND"
    advice = "unknown namespace: register the layout first"


class ResourceExhaustedError(KvTierError):
    code = "RESOURCE_EXHAUSTED"
    retryable = True
    advice = "the daemon cannot hold this now: back off and retry, or compute instead of caching"


class UnavailableError(KvTierError, ConnectionError):
    code = "UNAVAILABLE"
    retryable = True
    advice = "the daemon is unreachable, starting or shutting down: retry"


class DataLossError(KvTierError):
    code = "DATA_LOSS"
    advice = "a stored chunk failed its checksum and was deleted: recompute it"


class FailedPreconditionError(KvTierError):
    code = "FAILED_PRECONDITION"
    advice = "the request contradicts the daemon's state or configuration"


class DeadlineExceededError(KvTierError, TimeoutError):
    # Not retryable as it stands: the same call under the same deadline times out again.
    code = "DEADLINE_EXCEEDED"
    advice = "the call ran past its deadline: call again with a longer rpc_deadline or less data"


class CancelledError(KvTierError):
    code = "CANCELLED"
    advice = "the call was cancelled; nothing it was filling counts as loaded"


class AbortedError(KvTierError):
    code = "ABORTED"
    retryable = True
    advice = "a chunk changed while it was being sent: retry the call"


class InternalError(KvTierError):
    code = "INTERNAL"
    advice = "a protocol or server bug: report it; recompute meanwhile"


class UnimplementedError(KvTierError):
    code = "UNIMPLEMENTED"
    advice = "the daemon does not support this call: upgrade it"


class PermissionDeniedError(KvTierError):
    code = "PERMISSION_DENIED"
    advice = "this tenant may not do this (an admin operation, or a region it does not own)"


class UnauthenticatedError(KvTierError):
    code = "UNAUTHENTICATED"
    advice = "the daemon does not know these credentials: check the token or certificate"


_BY_CODE = {
    cls.code: cls
    for cls in (InvalidArgumentError, NotFoundError, ResourceExhaustedError, UnavailableError,
                DataLossError, FailedPreconditionError, DeadlineExceededError, CancelledError,
                AbortedError, InternalError, UnimplementedError, PermissionDeniedError,
                UnauthenticatedError)
}


def from_status(code: int, message: str) -> KvTierError:
    """The exception for an absl/gRPC status code number and message."""
    name = _CODE_NAMES.get(code, f"CODE_{code}")
    cls = _BY_CODE.get(name, KvTierError)
    return cls(message, code=name)
