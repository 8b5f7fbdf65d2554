"""The one datatype table (mpsd.ipc.dtypes) against what numpy, torch, the protocol and the config schema
say about each type, so that a wrong entry cannot pass as a conversion that silently changes sizes."""

from __future__ import annotations

from typing import get_args

import numpy as np
import pytest
import torch
from google.protobuf.descriptor import FieldDescriptor
from tritonclient.grpc import model_config_pb2 as triton_config
from tritonclient.grpc import service_pb2 as triton

from mpsd.config.model_config import DataType, TensorConfig
from mpsd.ipc.dtypes import DATATYPES, ITEMSIZE, config_to_wire, wire_to_config
from mpsd.worker.dtypes import FROM_TORCH, TO_TORCH, datatype_of
from mpsd.worker.strings import as_strings

# protobuf scalar type -> numpy kind and bytes it holds
_PROTO_KINDS = {
    FieldDescriptor.CPPTYPE_BOOL: ("b", 1),
    FieldDescriptor.CPPTYPE_INT32: ("i", 4),
    FieldDescriptor.CPPTYPE_INT64: ("i", 8),
    FieldDescriptor.CPPTYPE_UINT32: ("u", 4),
    FieldDescriptor.CPPTYPE_UINT64: ("u", 8),
    FieldDescriptor.CPPTYPE_FLOAT: ("f", 4),
    FieldDescriptor.CPPTYPE_DOUBLE: ("f", 8),
}


def test_the_config_schema_lists_exactly_the_tables_types() -> None:
    assert get_args(DataType) == tuple(d.config_name for d in DATATYPES.values())
    # Every datatype Triton's model config defines (Triton's own definition) is served.
    assert {d.config_name for d in DATATYPES.values()} == set(triton_config.DataType.keys()) - {
        "TYPE_INVALID"
    }


def test_strings_are_the_one_type_without_a_size_or_a_torch_dtype() -> None:
    entry = DATATYPES["BYTES"]
    assert (entry.itemsize, entry.torch, entry.contents) == (None, None, "bytes_contents")
    assert entry.config_name == "TYPE_STRING" and config_to_wire("TYPE_STRING") == "BYTES"
    assert wire_to_config("BYTES") == "TYPE_STRING"
    assert "BYTES" not in ITEMSIZE and "BYTES" not in TO_TORCH
    strings = as_strings(["a", b"b"])
    assert strings is not None and datatype_of(strings) == "BYTES"
    assert as_strings(np.zeros(2)) is None  # numbers are not strings


@pytest.mark.parametrize("name", sorted(set(DATATYPES) - {"BYTES"}))
def test_each_entry_agrees_with_numpy_torch_and_the_protocol(name: str) -> None:
    entry = DATATYPES[name]
    dtype = TO_TORCH[name]
    assert dtype.itemsize == entry.itemsize == ITEMSIZE[name]
    assert FROM_TORCH[dtype] == name
    if entry.numpy is not None:
        assert np.dtype(entry.numpy).itemsize == entry.itemsize
        assert torch.from_numpy(np.zeros(1, dtype=entry.numpy)).dtype == dtype
    if entry.contents is not None:  # Triton's own definition of the typed field, not mpsd's copy
        field = triton.InferTensorContents.DESCRIPTOR.fields_by_name[entry.contents]
        kind, width = _PROTO_KINDS[field.cpp_type]
        assert np.dtype(entry.numpy).kind == kind and entry.itemsize <= width, field.name
    tensor = TensorConfig(name="x", data_type=entry.config_name, dims=[1])  # type: ignore[arg-type]
    assert (tensor.wire_datatype, tensor.itemsize) == (name, entry.itemsize)
