"""The responses of one request to a decoupled model, on their way from the worker to the client.

At most UNSENT_LIMIT responses wait for the client; past that, `deliver` waits, the worker's part is not
acknowledged, and the model is not resumed: a slow client holds the model back instead of the daemon
buffering without limit. A client that goes away (the request's future is done) makes `deliver` say stop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from mpsd.daemon.dataplane.request import InferResult, OutputTensor, Timings

UNSENT_LIMIT = 8


class ResponseStream:
    def __init__(self, limit: int = UNSENT_LIMIT) -> None:
        self._parts: asyncio.Queue[InferResult] = asyncio.Queue(maxsize=limit)
        self.delivered = 0

    def sink(
        self, model: str, version: int, timings: Timings, done: asyncio.Future[Any]
    ) -> Callable[[list[tuple[OutputTensor, ...]]], Awaitable[bool]]:
        """Where an execution's parts go: each, as its one request's result, through `deliver`."""

        async def deliver(parts: list[tuple[OutputTensor, ...]]) -> bool:
            return await self.deliver(InferResult(model, version, parts[0], timings), done)

        return deliver

    async def deliver(self, result: InferResult, done: asyncio.Future[Any]) -> bool:
        """Hand one response on; False when nobody wants it (the request ended: cancelled, expired)."""
        if done.done():
            return False
        put = asyncio.ensure_future(self._parts.put(result))
        try:
            await asyncio.wait({put, done}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not put.done():
                put.cancel()
        if put.cancelled() or not put.done():
            return False
        self.delivered += 1
        return not done.done()

    async def responses(self, done: asyncio.Future[InferResult]) -> AsyncIterator[InferResult]:
        """Each response as it comes; ends when `done` does (raising its error), after the last one."""
        while True:
            getter = asyncio.ensure_future(self._parts.get())
            try:
                await asyncio.wait({getter, done}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not getter.done():
                    getter.cancel()
            if getter.done() and not getter.cancelled():
                yield getter.result()
                continue
            while not self._parts.empty():  # a response handed on just before the end
                yield self._parts.get_nowait()
            done.result()
            return
