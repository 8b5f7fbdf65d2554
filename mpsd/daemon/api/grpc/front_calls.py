"""ModelInfer as the front processes hand it over: on serialized bytes, each call with the traceparent its
front read; and, for a call whose header is known, submitted in the callback that read its frame.

A front's link reads many calls per read of its socket. Submitted there (`submit`), a known call is queued
at once and answered from its future: no task and no chain of coroutines per call, which cost an eighth
of the daemon's CPU per request at saturation (ResNet-50 on the H200: 99-103 against 86-91 us an image).
Every other call (a new header, a traced one, a model to load) takes `infer`, the servicer's bytes path,
in a task of its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from mpsd.daemon.api.grpc.inference import InferenceServicer
from mpsd.daemon.api.grpc.responses import ResponseTemplates
from mpsd.daemon.api.tracing import incoming
from mpsd.daemon.dataplane.request import InferResult
from mpsd.ipc.infer_wire import SplitRequest

Data = bytes | bytearray | memoryview | SplitRequest  # a request's bytes, or as its front split them
Parts = list[bytes | memoryview]


class Submitted:
    """A known call submitted to its model: its result's future, and the response once it is answered."""

    __slots__ = ("_id", "_responses", "_then", "future")

    def __init__(
        self, request_id: str, responses: ResponseTemplates, then: Callable[[Submitted], None]
    ) -> None:
        self._id = request_id
        self._responses = responses
        self._then = then
        self.future: asyncio.Future[InferResult] | None = None

    def settled(self, future: asyncio.Future[InferResult]) -> None:
        """The plane's `then`: the call is answered (or failed, or cancelled)."""
        self.future = future
        self._then(self)

    def parts(self) -> Parts:
        """The response's serialized pieces (the future has its result)."""
        assert self.future is not None
        return self._responses.parts(self.future.result(), self._id)


def front_calls(servicer: InferenceServicer) -> Callable[[Data, float | None, str | None], Awaitable[Parts]]:
    """ModelInfer for the front processes' calls, each with the traceparent its front read (if any)."""
    ops = servicer.ops

    async def infer(data: Data, deadline: float | None, traceparent: str | None) -> Parts:
        came = incoming(traceparent, "ModelInfer") if ops.tracing.on else None
        return await servicer.infer_serialized_parts(data, deadline, came)

    return infer


def front_submit(
    servicer: InferenceServicer,
) -> Callable[[SplitRequest, float | None, Callable[[Submitted], None]], asyncio.Future[Any] | None]:
    """A front's call submitted where its frame is read, when its header is known and tracing is off (a
    traced call's sampling and spans are `infer`'s): its future, and `then(call)` once it is answered;
    None: it takes `infer`. MpsdError as `infer` would raise it (the model is not ready, a full queue)."""
    ops = servicer.ops

    def submit(
        split: SplitRequest, deadline: float | None, then: Callable[[Submitted], None]
    ) -> asyncio.Future[Any] | None:
        if ops.tracing.on or not split.raw:
            return None
        found = servicer.known_call(split)
        if found is None:
            return None
        known, request_id, bind = found
        call = Submitted(request_id, servicer.responses, then)
        return ops.submit_checked(known.model, known.version, bind, deadline, call.settled)

    return submit
