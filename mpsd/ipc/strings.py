"""String tensors (BYTES) in Triton's serialized layout: each element, in row-major order, as its length
(uint32, little-endian) followed by its bytes.

Requests carry them so on the wire (raw contents, binary HTTP data, shared memory), the daemon passes them
to workers so, and a batch of string tensors is its requests' serialized bytes one after the other. This
module walks the layout; it imports neither numpy nor torch (the daemon checks requests without them).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

DATATYPE = "BYTES"
_LENGTH = struct.Struct("<I")
LENGTH_BYTES = _LENGTH.size


class MalformedStrings(ValueError):
    """Bytes that are not `count` serialized elements; the message says where they go wrong."""


def element_ends(data: bytes | bytearray | memoryview, count: int) -> list[int]:
    """The offset just past each of the `count` elements serialized in `data`, checking that they fill it
    exactly (no element cut short, nothing left over)."""
    view = memoryview(data).cast("B")
    size = len(view)
    unpack = _LENGTH.unpack_from
    ends = []
    at = 0
    for index in range(count):
        if at + LENGTH_BYTES > size:
            raise MalformedStrings(
                f"holds {index} string element(s) in {size} bytes, expected {count} "
                f"(each is a 4-byte little-endian length followed by its bytes)"
            )
        (length,) = unpack(view, at)
        at += LENGTH_BYTES + length
        if at > size:
            raise MalformedStrings(
                f"string element {index} declares {length} bytes but only {size - at + length} follow"
            )
        ends.append(at)
    if at != size:
        raise MalformedStrings(f"has {size - at} bytes after its {count} string element(s)")
    return ends


def split(data: bytes | bytearray | memoryview, count: int) -> list[bytes]:
    """The `count` elements serialized in `data`, as bytes objects."""
    view = memoryview(data).cast("B")
    elements = []
    start = 0
    for end in element_ends(view, count):
        elements.append(bytes(view[start + LENGTH_BYTES : end]))
        start = end
    return elements


def serialize(elements: Iterable[bytes]) -> bytes:
    """Elements (bytes, row-major) in the serialized layout."""
    pack = _LENGTH.pack
    parts = []
    for element in elements:
        parts.append(pack(len(element)))
        parts.append(element)
    return b"".join(parts)


def row_bounds(data: bytes | bytearray | memoryview, rows: int, per_row: int) -> list[int]:
    """Byte offsets at which each of `rows` rows of `per_row` elements starts, and the end: `rows + 1`
    offsets, so that row i is data[bounds[i]:bounds[i + 1]]."""
    ends = element_ends(data, rows * per_row)
    return [0, *(ends[(r + 1) * per_row - 1] if per_row else 0 for r in range(rows))]
