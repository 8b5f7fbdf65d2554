"""Triton's generate extension: `POST /v2/models/{model}[/versions/{version}]/generate` answers with one JSON
object, `/generate_stream` with server-sent events, one per response of a decoupled model.

The request is a JSON object whose keys other than `id` and `parameters` are the model's inputs by name, each
a number or a (nested) array of numbers of the input's datatype; it becomes the inference call an infer
request makes (`api.call`), so the same checks, queue and statistics apply. A response is a JSON object with
`model_name`, `model_version`, `id` when given, and each output by name: a single element as a number, more
as nested arrays in the output's shape. An error is `{"error": "..."}` (as an event, once a stream has begun).
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
from aiohttp import web

from mpsd.config.model_config import ModelConfig
from mpsd.daemon.api.call import InferCall, InputCall, RawEntry
from mpsd.daemon.api.operations import Answered, Operations
from mpsd.daemon.api.parse import check_name
from mpsd.daemon.api.tracing import came_over_http
from mpsd.daemon.api.web import read_body
from mpsd.errors import InvalidArgument, MpsdError
from mpsd.ipc import strings
from mpsd.ipc.dtypes import DATATYPES, config_to_wire

from .body import json_param, load_json
from .handlers import path, rpc
from .responses import dumps, json_response, json_values

RESERVED = ("id", "parameters")


def _request(body: Any, model: str, version: str, config: ModelConfig) -> InferCall:
    """The inference call a generate body stands for."""
    if not isinstance(body, dict):
        raise InvalidArgument("the generate request must be a JSON object of input names and values")
    request_id = ""
    if "id" in body:
        if not isinstance(body["id"], str):
            raise InvalidArgument("'id' must be a string")
        request_id = body["id"]
    params = body.get("parameters", {})
    if not isinstance(params, dict):
        raise InvalidArgument("'parameters' must be a JSON object")
    for key, value in params.items():
        if isinstance(value, float) or not isinstance(value, (bool, int, str)):
            raise InvalidArgument(f"parameter '{key}' must be a boolean, an integer or a string")
    names = {t.name: t for t in config.input}
    unknown = sorted(k for k in body if k not in names and k not in RESERVED)
    if unknown:
        raise InvalidArgument(f"unknown input(s) {', '.join(unknown)} (the model's: {', '.join(names)})")
    inputs: list[InputCall] = []
    raw: list[RawEntry] = []
    for tensor in config.input:
        if tensor.name not in body:
            continue  # a missing input is the unary path's error, named there
        datatype = config_to_wire(tensor.data_type)
        shape, data = _values(tensor.name, datatype, body[tensor.name])
        if config.max_batch_size > 0:
            shape = [1, *shape]
        inputs.append(InputCall(tensor.name, datatype, tuple(shape)))
        raw.append(data)
    parameters = {key: json_param(key, value, "the generate request") for key, value in params.items()}
    return InferCall(model, version, request_id, parameters, tuple(inputs), (), tuple(raw))


def _values(name: str, datatype: str, given: Any) -> tuple[list[int], bytes]:
    """An input's JSON value (a scalar or nested arrays; text for strings) as its shape and bytes."""
    spec = DATATYPES[datatype]
    if spec.numpy is None:
        raise InvalidArgument(f"input '{name}': {datatype} cannot be given as JSON numbers")
    try:
        array = np.asarray(given, dtype=np.dtype(spec.numpy))
        if datatype == strings.DATATYPE:
            if not all(isinstance(v, str) for v in array.flat):
                raise InvalidArgument(f"input '{name}': BYTES values must be strings")
            return list(array.shape) or [1], strings.serialize(v.encode() for v in array.flat)
    except (TypeError, ValueError, OverflowError) as exc:  # a lone surrogate is a UnicodeEncodeError
        raise InvalidArgument(f"input '{name}': not {datatype} values: {exc}") from None
    return list(array.shape) or [1], array.tobytes()


def _answer(answered: Answered, request_id: str) -> dict[str, Any]:
    result = answered.result
    out: dict[str, Any] = {"model_name": result.model, "model_version": str(result.version)}
    if request_id:
        out["id"] = request_id
    for tensor in result.outputs:
        values = json_values(tensor.datatype, tensor.data, tensor.shape)
        out[tensor.name] = values[0] if len(values) == 1 else np.array(values).reshape(tensor.shape).tolist()
    return out


class GenerateHandler:
    def __init__(self, ops: Operations, limit: int) -> None:
        self.ops = ops
        self.limit = limit

    async def _parse(self, request: web.Request) -> InferCall:
        model, version = path(request, "model"), path(request, "version")
        check_name("model", model)
        config, _ = self.ops.metadata(model, version)  # an unknown model is answered before its body is read
        body = load_json(await read_body(request, self.limit), "the generate request")
        return _request(body, model, version, config)

    @rpc("ModelInfer")
    async def generate(self, request: web.Request) -> web.Response:
        """One JSON answer: the model's response (a decoupled model must yield exactly one)."""
        # The parse is a span of the trace.
        came = came_over_http(request.headers, "HTTP generate") if self.ops.tracing.on else None
        infer = await self._parse(request)
        if not self.ops.decoupled(infer.model, infer.version):
            answered = await self.ops.infer(infer, came=came)
            with answered.trace.answering():
                return json_response(_answer(answered, infer.id))
        answers = [a async for a in self.ops.stream(infer, came=came)]
        if len(answers) != 1:
            raise InvalidArgument(
                f"model '{infer.model}' answered with {len(answers)} responses; /generate takes exactly "
                "one: use /generate_stream"
            )
        return json_response(_answer(answers[0], infer.id))

    @rpc("ModelStreamInfer")
    async def generate_stream(self, request: web.Request) -> web.StreamResponse:
        """Server-sent events: `data: {...}` per response, as the model yields it. A client that goes
        away stops the model at its next response."""
        came = came_over_http(request.headers, "HTTP generate_stream") if self.ops.tracing.on else None
        infer = await self._parse(request)
        stream = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        responses = self.ops.answers(infer, self.ops.decoupled(infer.model, infer.version), came)
        started = False
        try:
            async for answered in responses:
                if not started:
                    await stream.prepare(request)
                    started = True
                await stream.write(b"data: " + dumps(_answer(answered, infer.id)) + b"\n\n")
        except MpsdError as exc:
            if not started:
                raise  # before the first event: an ordinary HTTP error
            await stream.write(b"data: " + dumps({"error": exc.message}) + b"\n\n")
        finally:
            with contextlib.suppress(Exception):
                await responses.aclose()
        if not started:
            await stream.prepare(request)
        await stream.write_eof()
        return stream
