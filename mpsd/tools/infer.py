"""`mpsd infer`: call a model of a running daemon from the shell, without writing a client.

Values are given as JSON, scalars or `.npy` files; their datatype and shape come from the model's
metadata, so `INPUT0=[1,2,3]` is enough. When the metadata's first dimension is -1 (the batch) and the
value lacks it, a batch of one is sent.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from mpsd.ipc import strings
from mpsd.ipc.dtypes import DATATYPES, ITEMSIZE
from mpsd.tools.client import connect, inference_stub, rpc_failure
from mpsd.tools.common import ToolError, table

# numpy's dtype per datatype (BF16 has none: it travels as float32 values cut to 16 bits).
NUMPY: dict[str, Any] = {name: np.dtype(d.numpy).type for name, d in DATATYPES.items() if d.numpy is not None}
VALUE_HINT = "give NAME=VALUE with a JSON list (`'INPUT0=[1,2,3]'`), a number, or @file.npy"


@dataclass(frozen=True)
class TensorMeta:
    """One input or output as ModelMetadata describes it (shape with -1 for any size)."""

    name: str
    datatype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Output:
    name: str
    datatype: str
    array: np.ndarray[Any, Any]


# ---- values -------------------------------------------------------------------------------------------


def split_assignment(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name or not value:
        raise ToolError(f"--input {text!r}: expected NAME=VALUE", VALUE_HINT)
    return name, value


def read_value(name: str, value: str) -> np.ndarray[Any, Any]:
    """The array a VALUE stands for, before datatype and shape are applied."""
    if value.startswith("@"):
        path = Path(value[1:])
        try:
            loaded = np.load(path, allow_pickle=False)
        except FileNotFoundError:
            raise ToolError(f"input '{name}': {path} does not exist", VALUE_HINT) from None
        except (OSError, ValueError) as exc:
            raise ToolError(
                f"input '{name}': {path} is not a readable .npy file ({exc})", "write it with numpy.save"
            ) from None
        if not isinstance(loaded, np.ndarray):
            raise ToolError(f"input '{name}': {path} holds several arrays", "pass one .npy file per input")
        return loaded
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ToolError(f"input '{name}': {value!r} is not JSON ({exc.msg})", VALUE_HINT) from None
    try:
        array = np.asarray(parsed)
    except ValueError as exc:  # ragged nested lists
        hint = "every row of a nested list needs the same length"
        raise ToolError(f"input '{name}': {exc}", hint) from None
    if array.dtype.kind not in "biufU":
        raise ToolError(
            f"input '{name}': values must be numbers, booleans or strings, got {value!r}", VALUE_HINT
        )
    return array


def _cast(name: str, array: np.ndarray[Any, Any], datatype: str) -> np.ndarray[Any, Any]:
    """Convert to the model's datatype, refusing conversions that would change a value silently."""
    if datatype == strings.DATATYPE:
        if array.dtype.kind not in "US":
            raise ToolError(f"input '{name}' is BYTES: give strings", VALUE_HINT)
        return array.astype(np.object_)
    if array.dtype.kind in "US":
        raise ToolError(f"input '{name}' is {datatype}: give numbers, not strings", VALUE_HINT)
    target = np.dtype(np.float32 if datatype == "BF16" else NUMPY[datatype])
    if array.dtype == target:
        return array
    if target.kind == "b":
        if array.dtype.kind not in "biu" or not np.isin(array, (0, 1)).all():
            raise ToolError(f"input '{name}' is BOOL: use true/false or 0/1", VALUE_HINT)
    elif target.kind in "iu":
        if array.dtype.kind == "f" and not (np.isfinite(array).all() and (array == np.round(array)).all()):
            raise ToolError(f"input '{name}' is {datatype}: its values must be whole numbers", VALUE_HINT)
        info = np.iinfo(target)
        if array.size and (array.min() < info.min or array.max() > info.max):
            raise ToolError(
                f"input '{name}' is {datatype}: values must lie in {info.min}..{info.max}", VALUE_HINT
            )
    return array.astype(target)


def _fit_shape(
    name: str, array: np.ndarray[Any, Any], shape: Sequence[int], batch: int = 1
) -> np.ndarray[Any, Any]:
    """Fill the shape with a scalar (`batch` rows), add the batch dimension when the value lacks it;
    refuse the rest."""
    given = list(array.shape)
    if array.ndim == 0 and all(d != -1 for d in shape[1:]):
        array = np.full([batch if d == -1 else d for d in shape], array, dtype=array.dtype)
    elif shape and shape[0] == -1 and array.ndim == len(shape) - 1:
        array = array[np.newaxis]
    got = array.shape
    if len(got) != len(shape) or any(want not in (-1, have) for want, have in zip(shape, got, strict=True)):
        expected = "[" + ", ".join("any" if d == -1 else str(d) for d in shape) + "]"
        note = " (or without the first, batch, dimension)" if shape and shape[0] == -1 else ""
        raise ToolError(
            f"input '{name}': value has shape {given}, the model expects {expected}{note}",
            "`mpsd infer` takes the shape from the model's metadata; reshape the value to match",
        )
    return array


def to_bf16_bytes(array: np.ndarray[Any, Any]) -> bytes:
    """float32 -> bfloat16 (round to nearest even), as raw little-endian bytes."""
    bits = np.ascontiguousarray(array, dtype="<f4").view("<u4").astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype("<u2").tobytes()


def from_bf16_bytes(data: bytes, shape: Sequence[int]) -> np.ndarray[Any, Any]:
    halves = np.frombuffer(data, dtype="<u2").astype("<u4") << 16
    return halves.view("<f4").reshape(shape)


def encode(meta: TensorMeta, array: np.ndarray[Any, Any], batch: int = 1) -> tuple[list[int], bytes]:
    """Shape and raw bytes for the request (the protocol's raw tensors are little-endian, row-major)."""
    fitted = _fit_shape(meta.name, _cast(meta.name, array, meta.datatype), meta.shape, batch)
    if meta.datatype == "BF16":
        return list(fitted.shape), to_bf16_bytes(fitted)
    if meta.datatype == strings.DATATYPE:
        elements = (e.encode() if isinstance(e, str) else bytes(e) for e in fitted.reshape(-1))
        return list(fitted.shape), strings.serialize(elements)
    wire = np.dtype(NUMPY[meta.datatype]).newbyteorder("<")
    return list(fitted.shape), np.ascontiguousarray(fitted, dtype=wire).tobytes()


def decode(datatype: str, shape: Sequence[int], data: bytes) -> np.ndarray[Any, Any]:
    if datatype == "BF16":
        return from_bf16_bytes(data, shape)
    if datatype == strings.DATATYPE:
        try:
            elements = strings.split(data, math.prod(shape))
        except strings.MalformedStrings as exc:
            raise ToolError(f"the daemon sent BYTES data that {exc}") from None
        text = np.empty(len(elements), dtype=np.object_)
        text[:] = [e.decode("utf-8", "backslashreplace") for e in elements]
        return text.reshape(shape)
    if datatype not in NUMPY:
        raise ToolError(f"cannot show an output of datatype {datatype}")
    expected = math.prod(shape) * ITEMSIZE[datatype]
    if len(data) != expected:
        raise ToolError(f"the daemon sent {len(data)} bytes for shape {list(shape)} of {datatype}")
    return np.frombuffer(data, dtype=np.dtype(NUMPY[datatype]).newbyteorder("<")).reshape(shape)


def build_inputs(
    metas: Sequence[TensorMeta], assignments: Sequence[str]
) -> list[tuple[TensorMeta, list[int], bytes]]:
    """Every input the model declares, in its order, from the `--input` arguments."""
    given: dict[str, str] = {}
    by_name = {m.name: m for m in metas}
    for text in assignments:
        name, value = split_assignment(text)
        if name not in by_name:
            raise ToolError(
                f"the model has no input '{name}'", f"its inputs are: {', '.join(by_name) or 'none'}"
            )
        if name in given:
            raise ToolError(f"input '{name}' is given twice", "give each input once")
        given[name] = value
    missing = [m for m in metas if m.name not in given]
    if missing:
        shapes = ", ".join(f"{m.name} ({m.datatype} {list(m.shape)})" for m in missing)
        raise ToolError(f"missing input(s): {shapes}", VALUE_HINT)
    values = {m.name: read_value(m.name, given[m.name]) for m in metas}
    # A scalar fills its whole tensor, with as many rows as the other inputs' batch.
    batch = next(
        (
            _fit_shape(m.name, values[m.name], m.shape).shape[0]
            for m in metas
            if values[m.name].ndim > 0 and m.shape and m.shape[0] == -1
        ),
        1,
    )
    return [(m, *encode(m, values[m.name], batch)) for m in metas]


# ---- output --------------------------------------------------------------------------------------------


def _values(array: np.ndarray[Any, Any]) -> str:
    """One line per tensor, long ones elided in the middle."""
    text = np.array2string(array, separator=", ", threshold=64, edgeitems=4, max_line_width=sys.maxsize)
    return re.sub(r"\n\s*", " ", text)


def render_table(model: str, version: str, outputs: Sequence[Output]) -> str:
    rows = [[o.name, o.datatype, str(list(o.array.shape)), _values(o.array)] for o in outputs]
    return f"{model} version {version}\n" + table(["OUTPUT", "DATATYPE", "SHAPE", "VALUES"], rows)


def as_json(model: str, version: str, outputs: Sequence[Output]) -> dict[str, Any]:
    """KServe v2's JSON response layout: `data` is the flat, row-major list of values."""
    return {
        "model_name": model,
        "model_version": version,
        "outputs": [
            {
                "name": o.name,
                "datatype": o.datatype,
                "shape": list(o.array.shape),
                "data": o.array.reshape(-1).tolist(),
            }
            for o in outputs
        ],
    }


def compact_json(document: object) -> str:
    """Indented JSON with each list of numbers (a shape, a tensor's data) kept on one line."""
    text = json.dumps(document, indent=2)
    return re.sub(
        r"\[\s*([^\[\]{}\"]*?)\s*\]", lambda m: "[" + ", ".join(re.split(r",\s*", m.group(1))) + "]", text
    )


def write_npy(directory: Path, outputs: Sequence[Output]) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for o in outputs:
        path = directory / (o.name.replace("/", "_") + ".npy")
        np.save(path, o.array, allow_pickle=False)
        written.append(path)
    return written


# ---- the command -------------------------------------------------------------------------------------


def _metas(tensors: Any) -> list[TensorMeta]:
    return [TensorMeta(t.name, t.datatype, tuple(int(d) for d in t.shape)) for t in tensors]


def call(
    conn: argparse.Namespace,
    model: str,
    version: str,
    assignments: Sequence[str],
    outputs: Sequence[str],
    timeout: float,
) -> tuple[str, list[Output]]:
    """Fetch the model's metadata, send one request, return the version that answered and its outputs."""
    from mpsd.proto import grpc_service_pb2 as pb

    with connect(conn) as channel:
        stub = inference_stub(channel, conn.address, timeout)
        try:
            meta = stub.ModelMetadata(pb.ModelMetadataRequest(name=model, version=version), timeout=timeout)
        except grpc.RpcError as exc:
            raise rpc_failure(exc) from None
        request = pb.ModelInferRequest(model_name=model, model_version=version)
        for tensor_meta, shape, data in build_inputs(_metas(meta.inputs), assignments):
            request.inputs.add(name=tensor_meta.name, datatype=tensor_meta.datatype, shape=shape)
            request.raw_input_contents.append(data)
        known = {o.name for o in meta.outputs}
        for name in outputs:
            if name not in known:
                raise ToolError(f"the model has no output '{name}'", f"its outputs are: {', '.join(known)}")
            request.outputs.add(name=name)
        try:
            response = stub.ModelInfer(request, timeout=timeout)
        except grpc.RpcError as exc:
            raise rpc_failure(exc) from None
    if len(response.raw_output_contents) != len(response.outputs):
        raise ToolError("the response carries no raw output contents", "is the server mpsd or Triton?")
    results = [
        Output(o.name, o.datatype, decode(o.datatype, list(o.shape), data))
        for o, data in zip(response.outputs, response.raw_output_contents, strict=True)
    ]
    return response.model_version, results


def run(
    conn: argparse.Namespace,
    model: str,
    version: str,
    assignments: Sequence[str],
    outputs: Sequence[str],
    output_format: str,
    output_dir: Path,
    timeout: float,
) -> int:
    answered, results = call(conn, model, version, assignments, outputs, timeout)
    if output_format == "json":
        print(compact_json(as_json(model, answered, results)))
    elif output_format == "npy":
        for path in write_npy(output_dir, results):
            print(path)
    else:
        print(render_table(model, answered, results))
    return 0
