"""The flow of one ModelStreamInfer call: its requests run concurrently and their responses share the one
stream, within a window, so one stream cannot fill the daemon's memory.

An ordinary model's response waits for the response of the request before it (request order); a decoupled
model's responses go out as the model yields them, interleaved with the rest. At most `window` requests are
in progress and at most `window` responses wait to be written: past that the stream stops reading, a
decoupled model is held at its next response, and HTTP/2 flow control holds the client back.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

from mpsd.net.tasks import TaskGroup


class RequestStream:
    """One stream's requests in progress (they end with the stream) and its responses waiting to be
    written. What a request is answered with comes from the servicer: `answer` gives an ordinary model's
    one response, `answers` a decoupled model's responses, both with errors in-band; `decoupled` tells
    which a request is for."""

    def __init__(
        self,
        answer: Callable[[Any], Awaitable[Any]],
        answers: Callable[[Any], AsyncIterator[Any]],
        decoupled: Callable[[Any], bool],
        window: int,
    ) -> None:
        self._answer = answer
        self._answers = answers
        self._decoupled = decoupled
        self._out: asyncio.Queue[Any] = asyncio.Queue(maxsize=window)
        self._window = asyncio.Semaphore(window)
        self._tasks = TaskGroup()

    async def responses(self, requests: AsyncIterator[Any]) -> AsyncGenerator[Any, None]:
        """The responses to `requests`, until the client's side ends and every request is answered; when
        the stream goes away first, its requests in progress are ended."""
        reader = asyncio.create_task(self._read(requests))
        try:
            while (response := await self._out.get()) is not None:
                yield response
        finally:
            reader.cancel()
            await self._tasks.close()

    async def _read(self, requests: AsyncIterator[Any]) -> None:
        loop = asyncio.get_running_loop()
        before: asyncio.Future[None] | None = None
        try:
            async for request in requests:
                await self._window.acquire()
                if self._decoupled(request):
                    self._tasks.spawn(self._respond_decoupled(request))
                else:
                    sent: asyncio.Future[None] = loop.create_future()
                    self._tasks.spawn(self._respond(request, before, sent))
                    before = sent
            await self._tasks.join()
        finally:
            await self._out.put(None)

    async def _respond(
        self, request: Any, before: asyncio.Future[None] | None, sent: asyncio.Future[None]
    ) -> None:
        """An ordinary model's response, written after the one to the request `before` it; `sent` tells
        the next one."""
        try:
            response = await self._answer(request)
            if before is not None:
                await before
            await self._out.put(response)
        finally:
            if not sent.done():
                sent.set_result(None)
            self._window.release()

    async def _respond_decoupled(self, request: Any) -> None:
        try:
            async for response in self._answers(request):
                await self._out.put(response)
        finally:
            self._window.release()
