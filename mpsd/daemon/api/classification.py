"""Triton's classification extension: an output requested with the parameter `classification: K` is
answered, instead of its values, with its top K classes as strings `"value:index"`, or
`"value:index:label"` where the output has a label for the index (`label_filename`).

A batched model's output is classified row by row (shape [batch, K]); an unbatched one as a whole (shape
[K]); K is at most the number of values classified. Values are written as C++'s `std::to_string` writes
them, as Triton does: six decimals for floating point, plain integers otherwise. Equal values are ranked by
index, lowest first.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from mpsd.daemon.api.call import InferCall, Param
from mpsd.daemon.dataplane.request import InferResult, OutputTensor
from mpsd.errors import InvalidArgument
from mpsd.ipc import strings
from mpsd.ipc.dtypes import DATATYPES

PARAM = "classification"
# Types Triton classifies: the integer and the float32/64 ones.
CLASSIFIABLE = frozenset(
    {"UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP32", "FP64"}
)


def class_count(name: str, value: Param) -> int:
    """The K an output's `classification` parameter asks for (0: its values, not classes)."""
    count = value.integer()
    if count is None or count < 0:
        raise InvalidArgument(
            f"output '{name}': parameter '{PARAM}' must be a non-negative integer (the number of classes)"
        )
    return count


def requested(call: InferCall) -> dict[str, int]:
    """The outputs a call asks classes of, with K (empty for nearly every call)."""
    wanted: dict[str, int] = {}
    for out in call.outputs:
        value = out.parameters.get(PARAM) if out.parameters else None
        if value is not None and (count := class_count(out.name, value)) > 0:
            wanted[out.name] = count
    return wanted


def classify(
    result: InferResult, wanted: Mapping[str, int], batched: bool, labels: Mapping[str, Sequence[str]]
) -> InferResult:
    """The result with each wanted output replaced by its classes."""
    outputs = tuple(
        top_classes(o, wanted[o.name], batched, labels.get(o.name, ())) if o.name in wanted else o
        for o in result.outputs
    )
    return InferResult(result.model, result.version, outputs, result.timings)


def top_classes(out: OutputTensor, count: int, batched: bool, labels: Sequence[str]) -> OutputTensor:
    if out.datatype not in CLASSIFIABLE:
        raise InvalidArgument(
            f"class result not available for output due to unsupported type '{out.datatype}'"
        )
    values = np.frombuffer(out.data, dtype=np.dtype(DATATYPES[out.datatype].numpy).newbyteorder("<"))
    rows = out.shape[0] if batched and out.shape else 1
    per_row = math.prod(out.shape) // rows if rows else 0
    k = min(count, per_row)
    floating = values.dtype.kind == "f"
    elements: list[bytes] = []
    for row in values.reshape(rows, per_row):
        # Descending by value, equal values by index: a stable ascending sort of the reversed row, reversed.
        order = (per_row - 1) - np.argsort(row[::-1], kind="stable")[::-1][:k]
        for index in order.tolist():
            value = row[index]
            text = f"{float(value):f}" if floating else str(int(value))
            label = labels[index] if index < len(labels) else ""
            elements.append(f"{text}:{index}:{label}".encode() if label else f"{text}:{index}".encode())
    shape = (rows, k) if batched and out.shape else (k,)
    return OutputTensor(out.name, strings.DATATYPE, shape, strings.serialize(elements))
