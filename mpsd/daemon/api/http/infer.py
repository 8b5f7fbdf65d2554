"""`POST /v2/models/{model}[/versions/{version}]/infer`: read the body within the size limit, hand the
request to the same operations as gRPC (`Operations.infer`: validation, batching, deadlines, queue limits,
statistics), write the response."""

from __future__ import annotations

from aiohttp import web

from mpsd.daemon.api.operations import Operations
from mpsd.daemon.api.parse import check_name
from mpsd.daemon.api.tracing import came_over_http
from mpsd.daemon.api.web import read_body

from .body import HEADER_LENGTH, parse_infer_body
from .handlers import rpc
from .responses import infer_response


class InferHandler:
    def __init__(self, ops: Operations, limit: int) -> None:
        self.ops = ops
        self.limit = limit

    @rpc("ModelInfer")
    async def infer(self, request: web.Request) -> web.Response:
        came = came_over_http(request.headers, "HTTP ModelInfer") if self.ops.tracing.on else None
        model, version = request.match_info.get("model", ""), request.match_info.get("version", "")
        check_name("model", model)
        self.ops.registry.known(model, version)  # an unknown model is answered before its body is read
        body = await read_body(request, self.limit)
        parsed = parse_infer_body(body, request.headers.get(HEADER_LENGTH), model, version)
        answered = await self.ops.infer(parsed.call, came=came)
        with answered.trace.answering():
            return infer_response(
                answered.result, parsed.call.id, answered.in_shm, parsed.binary, parsed.binary_default
            )
