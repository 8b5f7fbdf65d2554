"""The HTTP body limit at its boundary (api/web.py's read_body, on a real aiohttp server on loopback in this
process): a body of exactly max_message_bytes is read, one byte more is refused with 413, whether it comes
with its length, chunked (no length declared) or gzip-compressed (the limit holds for it inflated)."""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest
from aiohttp import web

from mpsd.daemon.api.web import read_body

LIMIT = 1 << 16
CHUNK = 1 << 12


async def _echo_length(request: web.Request) -> web.Response:
    body = await read_body(request, LIMIT)
    return web.Response(text=str(body.nbytes))


async def _chunks(size: int) -> AsyncIterator[bytes]:
    data = b"x" * size
    for start in range(0, size, CHUNK):
        yield data[start : start + CHUNK]


def _plain(size: int) -> tuple[object, dict[str, str]]:
    return b"x" * size, {}


def _chunked(size: int) -> tuple[object, dict[str, str]]:
    return _chunks(size), {}


def _gzip(size: int) -> tuple[object, dict[str, str]]:
    return gzip.compress(b"x" * size), {"Content-Encoding": "gzip"}


def _gzip_chunked(size: int) -> tuple[object, dict[str, str]]:
    compressed = gzip.compress(b"x" * size)

    async def parts() -> AsyncIterator[bytes]:
        for start in range(0, len(compressed), 64):
            yield compressed[start : start + 64]

    return parts(), {"Content-Encoding": "gzip"}


BODIES = {"plain": _plain, "chunked": _chunked, "gzip": _gzip, "gzip-chunked": _gzip_chunked}


def _post(make: Callable[[int], tuple[object, dict[str, str]]], size: int) -> tuple[int, str]:
    async def body() -> tuple[int, str]:
        app = web.Application()
        app.router.add_post("/", _echo_length)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            data, headers = make(size)
            async with (
                aiohttp.ClientSession() as session,
                session.post(f"http://127.0.0.1:{port}/", data=data, headers=headers) as response,
            ):
                return response.status, await response.text()
        finally:
            await runner.cleanup()

    return asyncio.run(body())


@pytest.mark.parametrize("kind", BODIES)
def test_a_body_of_exactly_the_limit_is_read(kind: str) -> None:
    assert _post(BODIES[kind], LIMIT) == (200, str(LIMIT))


@pytest.mark.parametrize("kind", BODIES)
def test_a_body_one_byte_over_the_limit_is_refused_with_413(kind: str) -> None:
    status, text = _post(BODIES[kind], LIMIT + 1)
    assert status == 413 and "max_message_bytes" in text, (status, text)
