"""Triton's data types as `triton_python_backend_utils` names them: the config's `TYPE_*` strings, the
numeric codes of TRITONSERVER_DataType (what `numpy_to_triton_type` and `Tensor.triton_dtype` answer),
and the length-prefixed layout of a BYTES tensor (`serialize_byte_tensor`, `deserialize_bytes_tensor`)."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

# The config's names (triton_string_to_numpy); Triton maps TYPE_BOOL to Python's bool.
TRITON_STRING_TO_NUMPY: dict[str, Any] = {
    "TYPE_BOOL": bool,
    "TYPE_UINT8": np.uint8,
    "TYPE_UINT16": np.uint16,
    "TYPE_UINT32": np.uint32,
    "TYPE_UINT64": np.uint64,
    "TYPE_INT8": np.int8,
    "TYPE_INT16": np.int16,
    "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64,
    "TYPE_FP16": np.float16,
    "TYPE_FP32": np.float32,
    "TYPE_FP64": np.float64,
    "TYPE_STRING": np.object_,
}

# TRITONSERVER_DataType's codes, in its order (BOOL is 1, BYTES 13).
_CODES: tuple[tuple[int, Any], ...] = (
    (1, np.bool_),
    (2, np.uint8),
    (3, np.uint16),
    (4, np.uint32),
    (5, np.uint64),
    (6, np.int8),
    (7, np.int16),
    (8, np.int32),
    (9, np.int64),
    (10, np.float16),
    (11, np.float32),
    (12, np.float64),
    (13, np.object_),
)
BYTES_CODE = 13


def triton_string_to_numpy(triton_type_string: str) -> Any:
    return TRITON_STRING_TO_NUMPY[triton_type_string]


def triton_to_numpy_type(data_type: int) -> Any:
    """The numpy type of a TRITONSERVER_DataType code; None for a code without one (as in Triton)."""
    return next((np_type for code, np_type in _CODES if code == data_type), None)


def numpy_to_triton_type(data_type: Any) -> int | None:
    """The TRITONSERVER_DataType code of a numpy type (np.bytes_ is BYTES too); None when there is none."""
    try:
        dtype = np.dtype(data_type)
    except TypeError:
        return None
    if dtype.type is np.bytes_:
        return BYTES_CODE
    return next((code for code, np_type in _CODES if np.dtype(np_type) == dtype), None)


def serialize_byte_tensor(input_tensor: np.ndarray[Any, Any]) -> Any:
    """A BYTES tensor as Triton lays it out: each element, in C order, as a little-endian uint32 length and
    its bytes (a str element as UTF-8). `()` for an empty tensor, None for a tensor that is not of bytes."""
    if input_tensor.size == 0:
        return ()
    if input_tensor.dtype != np.object_ and input_tensor.dtype.type is not np.bytes_:
        return None
    parts = []
    for item in input_tensor.reshape(-1, order="C").tolist():
        data = item if isinstance(item, bytes) else str(item).encode("utf-8")
        parts += [struct.pack("<I", len(data)), data]
    return b"".join(parts)


def deserialize_bytes_tensor(encoded_tensor: bytes) -> np.ndarray[Any, Any]:
    """The elements of a serialized BYTES tensor, as a flat numpy array of bytes objects."""
    items = []
    offset = 0
    view = memoryview(encoded_tensor)
    while offset < len(view):
        (length,) = struct.unpack_from("<I", view, offset)
        offset += 4
        items.append(bytes(view[offset : offset + length]))
        offset += length
    return np.array(items, dtype=np.object_)
