"""The body of an HTTP infer request: a JSON header, then the binary data of the inputs that give a
`binary_data_size` (Triton's binary tensor data extension), one after the other in input order.

The JSON becomes the inference call (`api.call`) the gRPC adapter also makes, and each input's data one
entry of its raw contents: a view of the body for binary data (not copied before the worker's region), or
the JSON elements (`Values`), made bytes only once the input has been checked against the model. The checks
against the model are shared (`parse_infer_request`); here only the HTTP framing and the JSON's shape are.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from mpsd.daemon.api.call import InferCall, InputCall, OutputCall, Param, RawEntry
from mpsd.daemon.api.client_shm import SHM_PARAMS
from mpsd.daemon.api.values import Values
from mpsd.errors import InvalidArgument

HEADER_LENGTH = "Inference-Header-Content-Length"
BINARY_DATA_SIZE = "binary_data_size"
REQUEST_KEYS = ("id", "parameters", "inputs", "outputs")
INPUT_KEYS = ("name", "shape", "datatype", "parameters", "data")
OUTPUT_KEYS = ("name", "parameters")
_INT64 = (-(2**63), 2**63 - 1)
_UINT64_MAX = 2**64 - 1
_JSON_TYPES = {dict: "an object", list: "an array", type(None): "null", str: "a string", bool: "a boolean"}


@dataclass
class InferBody:
    """A parsed infer body: the call, and how each output is to be returned."""

    call: InferCall
    binary: dict[str, bool] = field(default_factory=dict)  # outputs that set `binary_data`
    binary_default: bool = False  # the request's `binary_data_output`


def _kind(value: Any) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return "a number"
    return _JSON_TYPES.get(type(value), type(value).__name__)


def header_length(value: str | None, body_size: int) -> int:
    """Where the JSON ends: the Inference-Header-Content-Length header, or the whole body without it."""
    if value is None:
        return body_size
    text = value.strip()
    if not (text.isascii() and text.isdigit()) or len(text) > 20:
        raise InvalidArgument(f"{HEADER_LENGTH} {value[:40]!r} is not a byte count")
    length = int(text)
    if length == 0:
        raise InvalidArgument(f"{HEADER_LENGTH} is 0: a request needs its JSON header")
    if length > body_size:
        raise InvalidArgument(f"{HEADER_LENGTH} is {length} but the body has only {body_size} bytes")
    return length


def load_json(data: bytes | bytearray | memoryview, what: str) -> Any:
    """JSON text that must be UTF-8; every failure is InvalidArgument naming `what`."""
    try:
        text = str(data, "utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidArgument(f"{what} is not UTF-8: {exc.reason} at byte {exc.start}") from None
    try:
        return json.loads(text)
    except RecursionError:
        raise InvalidArgument(f"{what} nests too deeply") from None
    except ValueError as exc:
        raise InvalidArgument(f"{what} is not valid JSON: {exc}") from None


def _object(value: Any, where: str, keys: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidArgument(f"{where} must be a JSON object, got {_kind(value)}")
    unknown = sorted(k for k in value if k not in keys)
    if unknown:
        names = ", ".join(ascii(k)[:80] for k in unknown[:5])
        raise InvalidArgument(f"{where}: unknown field(s) {names} (accepted: {', '.join(keys)})")
    return value


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise InvalidArgument(f"{where} must be a string, got {_kind(value)}")
    return value


def json_param(key: str, value: Any, where: str) -> Param:
    """A JSON parameter value: its kind follows the JSON type (an integer is int64, or uint64 past it)."""
    if isinstance(value, bool):
        return Param("bool", value)
    if isinstance(value, int):
        if _INT64[0] <= value <= _INT64[1]:
            return Param("int64", value)
        if 0 <= value <= _UINT64_MAX:
            return Param("uint64", value)
        raise InvalidArgument(f"{where}: parameter '{key}' does not fit in 64 bits")
    if isinstance(value, float):
        return Param("double", value)
    if isinstance(value, str):
        return Param("string", value)
    raise InvalidArgument(f"{where}: parameter '{key}' must be a boolean, a number or a string")


def _parameters(value: Any, where: str) -> dict[str, Param]:
    if not isinstance(value, dict):
        raise InvalidArgument(f"{where}: 'parameters' must be a JSON object, got {_kind(value)}")
    return {key: json_param(key, item, where) for key, item in value.items()}


def _shape(value: Any, where: str) -> list[int]:
    if not isinstance(value, list) or not all(type(d) is int for d in value):
        raise InvalidArgument(f"{where}: 'shape' must be an array of integers")
    if any(not _INT64[0] <= d <= _INT64[1] for d in value):
        raise InvalidArgument(f"{where}: 'shape' has a dimension that does not fit in 64 bits")
    return value


class _Binary:
    """The binary part of the body, handed out input by input."""

    def __init__(self, body: memoryview, start: int) -> None:
        self.body = body
        self.pos = start

    def take(self, size: Any, where: str) -> memoryview:
        if type(size) is not int or size < 0:
            raise InvalidArgument(f"{where}: '{BINARY_DATA_SIZE}' must be a non-negative integer")
        left = len(self.body) - self.pos
        if size > left:
            raise InvalidArgument(
                f"{where}: '{BINARY_DATA_SIZE}' is {size} but only {left} bytes of binary data are left"
            )
        self.pos += size
        return self.body[self.pos - size : self.pos]


def parse_infer_body(body: memoryview, header: str | None, model: str, version: str) -> InferBody:
    """The call an infer body holds; `header` is its Inference-Header-Content-Length header."""
    length = header_length(header, len(body))
    top = _object(load_json(body[:length], "the JSON header"), "the request", REQUEST_KEYS)
    request_id = _string(top["id"], "'id'") if "id" in top else ""
    params: dict[str, Param] = {}
    binary_default = False
    if "parameters" in top:
        params = _parameters(top["parameters"], "request")
        if "binary_data_output" in params:
            binary_default = params["binary_data_output"].value is True
    inputs = top.get("inputs")
    if not isinstance(inputs, list):
        raise InvalidArgument(f"the request's 'inputs' must be an array, got {_kind(inputs)}")
    binary = _Binary(body, length)
    raw: list[RawEntry] = []
    tensors = [_input(raw, item, f"inputs[{i}]", binary) for i, item in enumerate(inputs)]
    if binary.pos != len(body):
        raise InvalidArgument(
            f"the body has {len(body) - binary.pos} bytes after the JSON header and the inputs' binary data"
        )
    outputs = top.get("outputs", [])
    if not isinstance(outputs, list):
        raise InvalidArgument(f"the request's 'outputs' must be an array, got {_kind(outputs)}")
    wanted: dict[str, bool] = {}
    asked = [_output(wanted, item, f"outputs[{i}]") for i, item in enumerate(outputs)]
    call = InferCall(model, version, request_id, params, tuple(tensors), tuple(asked), tuple(raw))
    return InferBody(call, wanted, binary_default)


def _input(raw: list[RawEntry], item: Any, where: str, binary: _Binary) -> InputCall:
    tensor = _object(item, where, INPUT_KEYS)
    for key in ("name", "datatype", "shape"):
        if key not in tensor:
            raise InvalidArgument(f"{where}: '{key}' is missing")
    name = _string(tensor["name"], f"{where}: 'name'")
    where = f"input '{name}'" if name.isprintable() and len(name) < 256 else where
    datatype = _string(tensor["datatype"], f"{where}: 'datatype'")
    shape = _shape(tensor["shape"], where)
    params = _parameters(tensor["parameters"], where) if "parameters" in tensor else {}
    given = [
        what
        for what, present in (
            ("'data'", "data" in tensor),
            (f"'{BINARY_DATA_SIZE}'", BINARY_DATA_SIZE in params),
            ("shared memory", bool(SHM_PARAMS & set(params))),
        )
        if present
    ]
    if len(given) != 1:
        wanted = f"'data', '{BINARY_DATA_SIZE}' (binary data after the JSON) or shared memory"
        found = f"got {' and '.join(given)}" if given else "got none"
        raise InvalidArgument(f"{where}: give its data in exactly one way: {wanted}; {found}")
    if "data" in tensor:
        if not isinstance(tensor["data"], list):
            raise InvalidArgument(f"{where}: 'data' must be an array, got {_kind(tensor['data'])}")
        raw.append(Values(tensor["data"]))
    elif BINARY_DATA_SIZE in params:
        raw.append(binary.take(params[BINARY_DATA_SIZE].value, where))
    return InputCall(name, datatype, tuple(shape), params)


def _output(binary: dict[str, bool], item: Any, where: str) -> OutputCall:
    output = _object(item, where, OUTPUT_KEYS)
    if "name" not in output:
        raise InvalidArgument(f"{where}: 'name' is missing")
    name = _string(output["name"], f"{where}: 'name'")
    params: dict[str, Param] = {}
    if "parameters" in output:
        params = _parameters(output["parameters"], f"output '{name}'"[:300])
        if "binary_data" in params:
            if params["binary_data"].kind != "bool":
                raise InvalidArgument(f"output '{name}'"[:300] + ": 'binary_data' must be a boolean")
            binary[name] = bool(params["binary_data"].value)
    return OutputCall(name, params)
