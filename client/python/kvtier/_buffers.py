"""Caller buffers as flat byte views, without copying.

Accepted: bytes (read-only), bytearray, memoryview, numpy arrays and CPU torch tensors,
each C-contiguous. The result is a 1-D unsigned-byte memoryview over the same memory;
the native layer holds it through the buffer protocol for the whole call.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ._layout import DType
from .errors import InvalidArgumentError

# Element types that may carry a layout's dtype. Raw bytes (uint8/int8) always may.
_NUMPY_DTYPES = {np.dtype("float16"): DType.FLOAT16, np.dtype("float32"): DType.FLOAT32}
_TORCH_DTYPES = {"torch.float16": DType.FLOAT16, "torch.bfloat16": DType.BFLOAT16,
                 "torch.float32": DType.FLOAT32, "torch.float8_e4m3fn": DType.FLOAT8_E4M3,
                 "torch.float8_e5m2": DType.FLOAT8_E5M2}
_RAW = {"uint8", "int8", "torch.uint8", "torch.int8"}


def _is_torch_tensor(obj) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr")


def _check_dtype(name: str, got: str, mapped: Optional[DType], want: Optional[DType]):
    if want is None or got in _RAW:
        return
    if mapped != want:
        raise InvalidArgumentError(
            f"{name}: element type {got} does not match the layout's dtype "
            f"{want.name.lower()}; pass a {want.name.lower()} (or uint8) buffer")


def byte_view(obj, name: str, writable: bool, dtype: Optional[DType] = None) -> memoryview:
    """A flat writable-if-asked byte view of ``obj``. Raises InvalidArgumentError."""
    if _is_torch_tensor(obj):
        if obj.device.type != "cpu":
            raise InvalidArgumentError(
                f"{name}: tensor is on {obj.device}; the gRPC path takes host tensors")
        if not obj.is_contiguous():
            raise InvalidArgumentError(
                f"{name}: tensor is not contiguous (strides {tuple(obj.stride())}); "
                "call .contiguous() or pass a contiguous buffer")
        _check_dtype(name, str(obj.dtype), _TORCH_DTYPES.get(str(obj.dtype)), dtype)
        if obj.numel() == 0:
            return memoryview(b"" if not writable else bytearray())
        import torch  # Only reached with a torch tensor in hand.
        flat = obj.detach().reshape(-1)
        if flat.dtype != torch.uint8:
            flat = flat.view(torch.uint8)
        return memoryview(flat.numpy())
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise InvalidArgumentError(
                f"{name}: array is not C-contiguous; use np.ascontiguousarray or pass a "
                "contiguous buffer")
        if writable and not obj.flags.writeable:
            raise InvalidArgumentError(f"{name}: array is read-only")
        _check_dtype(name, str(obj.dtype), _NUMPY_DTYPES.get(obj.dtype), dtype)
        return memoryview(obj.reshape(-1).view(np.uint8))
    try:
        mv = memoryview(obj)
    except TypeError:
        raise InvalidArgumentError(
            f"{name}: {type(obj).__name__} is not a buffer (bytes, bytearray, memoryview, "
            "numpy array or CPU torch tensor)") from None
    if not mv.c_contiguous:
        raise InvalidArgumentError(f"{name}: buffer is not C-contiguous")
    if writable and mv.readonly:
        raise InvalidArgumentError(
            f"{name}: buffer is read-only ({type(obj).__name__}); pass a bytearray, a "
            "numpy array or a tensor to fill")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv
