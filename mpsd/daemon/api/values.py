"""Tensor elements given as numbers instead of bytes: typed `contents` on gRPC, a JSON array on HTTP.

Both become the tensor's bytes only after the request's names, datatypes and shapes have been checked,
and only when the element count is the one the shape declares, so the bytes made are never more than
the request itself holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from mpsd.errors import InvalidArgument
from mpsd.ipc import strings
from mpsd.ipc.dtypes import DATATYPES

# Python types a JSON array may hold for each datatype: booleans for BOOL, integers for the integer
# types, any number for the floating-point ones (bool is not an int here, as in JSON).
_BOOL: frozenset[type] = frozenset({bool})
_INT: frozenset[type] = frozenset({int})
_FLOAT: frozenset[type] = frozenset({int, float})


def check_range(what: str, datatype: str, np_type: Any, lo: int, hi: int) -> None:
    """Integers `lo`..`hi` fit the integer `np_type` (no-op for other types)."""
    if not np.issubdtype(np.dtype(np_type), np.integer):
        return
    info = np.iinfo(np_type)
    if lo < info.min or hi > info.max:
        raise InvalidArgument(f"{what}: value out of range for {datatype} ({lo}..{hi})")


def flatten(data: Any, what: str) -> list[Any]:
    """A nested list of elements in row-major order (KServe allows a flat or a nested array)."""
    if not isinstance(data, list):
        raise InvalidArgument(f"{what}: 'data' must be an array of numbers, got {type(data).__name__}")
    if not any(isinstance(v, list) for v in data):
        return data
    flat: list[Any] = []
    stack: list[tuple[list[Any], int]] = [(data, 0)]
    while stack:
        items, start = stack.pop()
        for i in range(start, len(items)):
            item = items[i]
            if isinstance(item, list):
                stack.append((items, i + 1))
                stack.append((item, 0))
                break
            flat.append(item)
    return flat


class Values:
    """One input's elements as a JSON array gave them; `encode` makes its bytes once it is checked."""

    __slots__ = ("data",)

    def __init__(self, data: Any) -> None:
        self.data = data

    def encode(self, what: str, datatype: str, count: int) -> bytes:
        if datatype == strings.DATATYPE:
            return _encode_strings(what, flatten(self.data, what), count)
        spec = DATATYPES.get(datatype)
        if spec is None or spec.numpy is None:  # BF16 (numpy has no type for it)
            raise InvalidArgument(f"{what}: {datatype} data must be sent as binary data (binary_data_size)")
        flat = flatten(self.data, what)
        if len(flat) != count:
            raise InvalidArgument(f"{what}: 'data' has {len(flat)} elements, expected {count}")
        np_type = np.dtype(spec.numpy).type
        if not flat:
            return b""
        kinds = set(map(type, flat))
        allowed: frozenset[type]
        if np_type is np.bool_:
            allowed, wanted = _BOOL, "booleans"
        elif np.issubdtype(np.dtype(np_type), np.integer):
            allowed, wanted = _INT, "integers"
        else:
            allowed, wanted = _FLOAT, "numbers"
        if not kinds <= allowed:
            got = ", ".join(sorted(k.__name__ for k in kinds - allowed))
            raise InvalidArgument(f"{what}: {datatype} data must be {wanted}, got {got}")
        if allowed is _INT:
            check_range(what, datatype, np_type, min(flat), max(flat))
        with np.errstate(over="ignore"):  # a float beyond FP16's range is inf, as Triton makes it
            try:
                return np.asarray(flat, dtype=np_type).tobytes()
            except OverflowError:  # an integer too large for any float (JSON allows 10**400)
                raise InvalidArgument(f"{what}: a value is too large for {datatype}") from None


def _encode_strings(what: str, flat: list[Any], count: int) -> bytes:
    """JSON strings as serialized BYTES elements (UTF-8), as Triton takes them."""
    if len(flat) != count:
        raise InvalidArgument(f"{what}: 'data' has {len(flat)} elements, expected {count}")
    kinds = {type(v) for v in flat}
    if not kinds <= {str}:
        got = ", ".join(sorted(k.__name__ for k in kinds - {str}))
        raise InvalidArgument(f"{what}: BYTES data must be strings, got {got}")
    try:
        return strings.serialize(v.encode("utf-8") for v in flat)
    except UnicodeEncodeError:  # a lone surrogate (\ud800) that JSON allows
        raise InvalidArgument(f"{what}: a string is not valid Unicode (a lone surrogate)") from None


def typed_bytes(what: str, datatype: str, values: Sequence[Any], np_type: Any) -> bytes:
    """Values of a typed `contents` field as the tensor's bytes, integers range checked."""
    if np_type is np.bool_:
        return np.asarray(values, dtype=np.bool_).tobytes()
    wide = np.asarray(values)
    if np.issubdtype(np.dtype(np_type), np.integer) and wide.size:
        check_range(what, datatype, np_type, int(wide.min()), int(wide.max()))
    return wide.astype(np_type).tobytes()
