"""An inference call as a client sent it, before any check: the form both protocol adapters read their
request into (gRPC from its ModelInferRequest, HTTP from its JSON and binary body), and the one the checks
against the model (`parse`) read. Nothing in it is protobuf or JSON.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mpsd.daemon.api.values import Values

# One entry of a call's raw contents: bytes, or elements that become bytes once the input is checked.
RawEntry = bytes | memoryview | Values
# The fields typed contents come in (gRPC's InferTensorContents), by which `InputCall.contents` holds them.
TYPED_CONTENTS = (
    "bool_contents",
    "int_contents",
    "int64_contents",
    "uint_contents",
    "uint64_contents",
    "fp32_contents",
    "fp64_contents",
    "bytes_contents",
)


@dataclass(frozen=True, slots=True)
class Param:
    """A parameter's value and its kind, as the protocol gives it: bool, int64, uint64, double or string
    (Triton's InferParameter kinds; gRPC's oneof says which, a JSON value's type says which on HTTP)."""

    kind: str
    value: bool | int | float | str

    def integer(self) -> int | None:
        """The value, when it is an integer parameter (None otherwise)."""
        return int(self.value) if self.kind in ("int64", "uint64") else None


Params = Mapping[str, Param]
NO_PARAMS: Params = {}  # shared by calls without parameters: never written to


@dataclass(frozen=True, slots=True)
class InputCall:
    """One input as the client sent it. `contents` are typed elements by the field that held them (gRPC's
    `contents`: `fp32_contents`, ...), empty when the data is in raw contents or shared memory."""

    name: str
    datatype: str
    shape: Sequence[int]
    parameters: Params = field(default_factory=dict)
    contents: Mapping[str, Sequence[Any]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class OutputCall:
    name: str
    parameters: Params = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class InferCall:
    """`raw` holds one entry per input not in shared memory, in input order (empty: the data is in typed
    contents or shared memory)."""

    model: str
    version: str
    id: str = ""
    parameters: Params = field(default_factory=dict)
    inputs: Sequence[InputCall] = ()
    outputs: Sequence[OutputCall] = ()
    raw: Sequence[RawEntry] = ()
