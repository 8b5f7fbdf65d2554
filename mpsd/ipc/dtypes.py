"""Tensor data types as the protocol names them, with their sizes; torch is deliberately not imported here
so that the daemon can validate requests without loading torch."""

from __future__ import annotations

# Protocol datatype name -> bytes per element.
ITEMSIZE: dict[str, int] = {
    "BOOL": 1,
    "UINT8": 1,
    "INT8": 1,
    "INT16": 2,
    "INT32": 4,
    "INT64": 8,
    "FP16": 2,
    "BF16": 2,
    "FP32": 4,
    "FP64": 8,
}

# Names Triton defines that mpsd does not serve, with the reason given to clients.
UNSUPPORTED: dict[str, str] = {
    "BYTES": "tensors of strings (BYTES) are not supported by this backend",
    "UINT16": "UINT16 tensors are not supported by this backend (PyTorch has no general uint16 support)",
    "UINT32": "UINT32 tensors are not supported by this backend (PyTorch has no general uint32 support)",
    "UINT64": "UINT64 tensors are not supported by this backend (PyTorch has no general uint64 support)",
}


def config_to_wire(data_type: str) -> str:
    """`TYPE_FP32` (model config spelling) -> `FP32` (inference protocol spelling)."""
    return data_type.removeprefix("TYPE_")


def wire_to_config(datatype: str) -> str:
    """`FP32` -> `TYPE_FP32`."""
    return "TYPE_" + datatype
