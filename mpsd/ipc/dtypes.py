"""Tensor data types as the protocol names them: the one table of what mpsd serves, with each type's size,
its typed field in InferTensorContents, and its numpy and torch dtypes.

BYTES (strings) has no fixed size: its elements travel serialized (mpsd.ipc.strings), and torch has no
tensor of them, so only python models take and return them.

The dtypes are names, not objects, so that ipc imports neither numpy nor torch: the daemon validates
requests without loading torch, and the worker (mpsd.worker.dtypes) turns the names into torch dtypes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Datatype:
    """One protocol datatype (`FP32`); the model config spells it `TYPE_FP32`."""

    name: str
    itemsize: int | None  # bytes per element; None: elements of their own sizes (BYTES)
    contents: str | None  # the typed field of InferTensorContents; None: raw contents only (FP16, BF16)
    numpy: str | None  # numpy's dtype name; None: numpy has none (BF16)
    torch: str | None  # the torch dtype's attribute name (`torch.float32`); None: torch has none (BYTES)

    @property
    def config_name(self) -> str:
        return wire_to_config(self.name)


DATATYPES: dict[str, Datatype] = {
    d.name: d
    for d in (
        Datatype("BOOL", 1, "bool_contents", "bool", "bool"),
        Datatype("UINT8", 1, "uint_contents", "uint8", "uint8"),
        # torch (2.3 on) holds the wider unsigned types, with few operators beyond copies and conversions.
        Datatype("UINT16", 2, "uint_contents", "uint16", "uint16"),
        Datatype("UINT32", 4, "uint_contents", "uint32", "uint32"),
        Datatype("UINT64", 8, "uint64_contents", "uint64", "uint64"),
        Datatype("INT8", 1, "int_contents", "int8", "int8"),
        Datatype("INT16", 2, "int_contents", "int16", "int16"),
        Datatype("INT32", 4, "int_contents", "int32", "int32"),
        Datatype("INT64", 8, "int64_contents", "int64", "int64"),
        Datatype("FP16", 2, None, "float16", "float16"),
        Datatype("BF16", 2, None, None, "bfloat16"),
        Datatype("FP32", 4, "fp32_contents", "float32", "float32"),
        Datatype("FP64", 8, "fp64_contents", "float64", "float64"),
        Datatype("BYTES", None, "bytes_contents", "object", None),
    )
}

# Protocol datatype name -> bytes per element, for the types of a fixed size.
ITEMSIZE: dict[str, int] = {name: d.itemsize for name, d in DATATYPES.items() if d.itemsize is not None}
# The one type whose elements are of their own sizes: strings, as Triton's config spells them.
STRING_CONFIG = "TYPE_STRING"


def config_to_wire(data_type: str) -> str:
    """`TYPE_FP32` (model config spelling) -> `FP32` (protocol spelling); `TYPE_STRING` -> `BYTES`."""
    return "BYTES" if data_type == STRING_CONFIG else data_type.removeprefix("TYPE_")


def wire_to_config(datatype: str) -> str:
    """`FP32` -> `TYPE_FP32`; `BYTES` -> `TYPE_STRING`."""
    return STRING_CONFIG if datatype == "BYTES" else "TYPE_" + datatype
