"""What the adapters served over HTTP share, below them all: the mark that gives a route its access method,
reading a body within the size limit, and a `Mount`, by which an adapter adds its routes to the daemon's
HTTP server (the KServe adapter's, `api.http`) with the way it words its errors.

The HTTP server's middleware (drain, access, errors) reads only what is here, so an adapter mounted on it
needs nothing from another adapter.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from aiohttp import web

from mpsd.errors import MpsdError

F = TypeVar("F", bound=Callable[..., Any])
METHOD_KEY = "mpsd_method"  # a route handler's attribute: the full method name its access is decided by


def method(name: str) -> Callable[[F], F]:
    """Mark a handler with the method (`/package.Service/Method`) whose access category it has."""

    def mark(handler: F) -> F:
        setattr(handler, METHOD_KEY, name)
        return handler

    return mark


def method_of(handler: Any) -> str | None:
    name = getattr(handler, METHOD_KEY, None)
    return name if isinstance(name, str) else None


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


# How an adapter answers an error: (HTTP status, message, the error when it is one of the taxonomy's,
# headers to add) -> the response.
ErrorWriter = Callable[[int, str, MpsdError | None, Mapping[str, str] | None], web.Response]
# What answers `Expect: 100-continue` (aiohttp's expect handler): None to go on, or the final response.
ExpectHandler = Callable[[web.Request], Awaitable[web.StreamResponse | None]]


@dataclass(frozen=True)
class Mount:
    """An adapter's routes on the daemon's HTTP server: every path under `prefix` is its own, and errors
    there, also those answered before its handler runs (access, drain, unknown paths, sizes), are worded
    by `errors`. `add_routes` is given the application and the handler of `Expect: 100-continue`, which
    admits a request before its body is sent."""

    prefix: str
    add_routes: Callable[[web.Application, ExpectHandler], None]
    errors: ErrorWriter
