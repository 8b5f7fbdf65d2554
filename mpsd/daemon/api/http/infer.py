"""`POST /v2/models/{model}[/versions/{version}]/infer`: read the body within the size limit, hand the
request to the same operations as gRPC (`Operations.infer`: validation, batching, deadlines, queue limits,
statistics), write the response."""

from __future__ import annotations

from aiohttp import web

from mpsd.daemon.api.operations import Operations
from mpsd.daemon.api.parse import check_name

from .body import HEADER_LENGTH, parse_infer_body
from .handlers import path, rpc
from .responses import infer_response


def too_large(declared: int | None, limit: int) -> web.HTTPRequestEntityTooLarge:
    """413 with a message that names the limit, sent before the body is read."""
    size = f"{declared} bytes" if declared is not None else "more than that"
    text = f"the request body is {size}; the limit is {limit} bytes (max_message_bytes)"
    return web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=declared or limit + 1, text=text)


async def read_body(request: web.Request, limit: int) -> memoryview:
    """The whole body in one buffer; a body over `limit` is refused as soon as its declared length, or the
    part read so far, says so. Nothing is allocated from the declared length (a client may declare the
    limit and send nothing), and the count is of the bytes as the handler sees them, so a compressed body
    (Content-Encoding: gzip or deflate, which aiohttp inflates) is held to the limit once inflated."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise too_large(declared, limit)
    chunks: list[bytes] = []
    received = 0
    while chunk := await request.content.readany():
        received += len(chunk)
        if received > limit:
            raise too_large(None, limit)
        chunks.append(chunk)
    return memoryview(chunks[0] if len(chunks) == 1 else b"".join(chunks))


class InferHandler:
    def __init__(self, ops: Operations, limit: int) -> None:
        self.ops = ops
        self.limit = limit

    @rpc("ModelInfer")
    async def infer(self, request: web.Request) -> web.Response:
        model, version = path(request, "model"), path(request, "version")
        check_name("model", model)
        self.ops.registry.known(model, version)  # an unknown model is answered before its body is read
        body = await read_body(request, self.limit)
        parsed = parse_infer_body(body, request.headers.get(HEADER_LENGTH), model, version)
        answered = await self.ops.infer(parsed.call)
        return infer_response(
            answered.result, parsed.call.id, answered.in_shm, parsed.binary, parsed.binary_default
        )
