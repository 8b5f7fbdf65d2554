"""Triton's serialized string layout (mpsd.ipc.strings) against tritonclient's own serializer, by
property: what the client writes is read back element for element, rows are found where they start, and
bytes cut anywhere short are refused."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor

from mpsd.ipc import strings

elements = st.lists(st.binary(max_size=40), min_size=1, max_size=24)


def _client_bytes(items: list[bytes]) -> bytes:
    array = np.empty(len(items), dtype=np.object_)
    array[:] = items
    return bytes(serialize_byte_tensor(array).item())


@given(elements)
def test_the_clients_layout_is_read_back_and_written_alike(items: list[bytes]) -> None:
    data = _client_bytes(items)
    assert strings.split(data, len(items)) == items
    assert strings.serialize(items) == data
    assert deserialize_bytes_tensor(strings.serialize(items)).tolist() == items


@given(elements, st.integers(1, 4))
def test_rows_start_where_their_first_element_does(items: list[bytes], rows: int) -> None:
    per_row = len(items) // rows
    items = items[: rows * per_row]
    data = strings.serialize(items)
    bounds = strings.row_bounds(data, rows, per_row)
    assert len(bounds) == rows + 1 and bounds[-1] == len(data)
    for r in range(rows):
        assert (
            strings.split(data[bounds[r] : bounds[r + 1]], per_row) == items[r * per_row : (r + 1) * per_row]
        )


@given(elements, st.data())
def test_bytes_cut_short_or_with_more_are_refused(items: list[bytes], data: st.DataObject) -> None:
    whole = strings.serialize(items)
    cut = data.draw(st.integers(0, len(whole) - 1))
    with pytest.raises(strings.MalformedStrings):
        strings.element_ends(whole[:cut], len(items))
    with pytest.raises(strings.MalformedStrings):
        strings.element_ends(whole + b"\x00", len(items))
