"""Tensor data types as the protocol names them: the one table of what mpsd serves, with each type's size,
its typed field in InferTensorContents, and its numpy and torch dtypes.

The dtypes are names, not objects, so that ipc imports neither numpy nor torch: the daemon validates
requests without loading torch, and the worker (mpsd.worker.dtypes) turns the names into torch dtypes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Datatype:
    """One protocol datatype (`FP32`); the model config spells it `TYPE_FP32`."""

    name: str
    itemsize: int  # bytes per element
    contents: str | None  # the typed field of InferTensorContents; None: raw contents only (FP16, BF16)
    numpy: str | None  # numpy's dtype name; None: numpy has none (BF16)
    torch: str  # the torch dtype's attribute name (`torch.float32`)

    @property
    def config_name(self) -> str:
        return wire_to_config(self.name)


DATATYPES: dict[str, Datatype] = {
    d.name: d
    for d in (
        Datatype("BOOL", 1, "bool_contents", "bool", "bool"),
        Datatype("UINT8", 1, "uint_contents", "uint8", "uint8"),
        Datatype("INT8", 1, "int_contents", "int8", "int8"),
        Datatype("INT16", 2, "int_contents", "int16", "int16"),
        Datatype("INT32", 4, "int_contents", "int32", "int32"),
        Datatype("INT64", 8, "int64_contents", "int64", "int64"),
        Datatype("FP16", 2, None, "float16", "float16"),
        Datatype("BF16", 2, None, None, "bfloat16"),
        Datatype("FP32", 4, "fp32_contents", "float32", "float32"),
        Datatype("FP64", 8, "fp64_contents", "float64", "float64"),
    )
}

# Protocol datatype name -> bytes per element.
ITEMSIZE: dict[str, int] = {name: d.itemsize for name, d in DATATYPES.items()}

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
