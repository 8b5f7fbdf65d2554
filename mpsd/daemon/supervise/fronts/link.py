"""The daemon's end of one front's socketpair: runs the ModelInfer calls the front hands over.

It runs them through the `infer` it is given (the inference servicer's, on serialized bytes), so the
link knows frames, the arena and flow control, and nothing of models.
"""

from __future__ import annotations

import asyncio
import struct
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import grpc
import structlog

from mpsd.daemon.dataplane.arenas import ARENAS
from mpsd.errors import Internal, MpsdError
from mpsd.ipc.front_arena import INFER_REF, Chunk, arena_view, referenced_request, write_reply
from mpsd.ipc.front_protocol import FrontReady, MalformedMessage

# A front holds its calls to MAX_IN_FLIGHT; should one ever send more, the daemon stops reading its socket.
from mpsd.ipc.front_wire import (
    MAX_IN_FLIGHT,
    Buffer,
    FrameWriter,
    FrontLinkProtocol,
    Kind,
    frame,
    frame_of,
)
from mpsd.ipc.infer_wire import ONE_RAW, SplitRequest, split_at, split_from_spans, unpack_spans
from mpsd.ipc.shm import Region
from mpsd.net.status import grpc_status

log = structlog.get_logger("mpsd.daemon.supervise.fronts")

# ModelInfer on request bytes; the response comes back as pieces to be sent back to back.
# A call's bytes (or the request as its front split them), its deadline and the caller's traceparent (None:
# none) -> the response's pieces.
Request = bytes | bytearray | memoryview | SplitRequest
InferBytes = Callable[[Request, float | None, str | None], Awaitable[Sequence[Buffer]]]


class SubmittedCall(Protocol):
    """A call queued where its frame was read, once it is answered (or failed, or cancelled)."""

    @property
    def future(self) -> asyncio.Future[Any] | None: ...

    def parts(self) -> Sequence[Buffer]:
        """The response's pieces, once the future has its result."""
        ...


# A split call submitted at once, no task of its own: its future, `then(call)` called once it is answered
# (None: it goes to `InferBytes` in a task). Raises MpsdError where the task would have failed with it.
Submit = Callable[[SplitRequest, float | None, Callable[[SubmittedCall], None]], asyncio.Future[Any] | None]
# Keys a front may have declared at once (it declares at most 1024 before it starts again).
MAX_DECLARED = 4096
_CALLS = frozenset((Kind.INFER, Kind.INFER_SHM, Kind.INFER_SPLIT, Kind.INFER_SPLIT_SHM))
_SPLIT = frozenset((Kind.INFER_SPLIT, Kind.INFER_SPLIT_SHM))
_IN_ARENA = frozenset((Kind.INFER_SHM, Kind.INFER_SPLIT_SHM))
# An INFER_SPLIT_SHM payload of one raw entry: its spans (`Spans.pack`), then its arena reference.
_ONE_RAW_IN_ARENA = struct.Struct(ONE_RAW.format + INFER_REF.format.lstrip("!"))

_INTERNAL = grpc.StatusCode.INTERNAL.value[0]
_CANCELLED = grpc.StatusCode.CANCELLED.value[0]


def _spanned(split: SplitRequest | None) -> SplitRequest:
    if split is None:
        raise Internal("request spans reach outside the request")
    return split


class FrontFailed(Exception):
    """A front process could not start (its reason, or how it exited)."""


@dataclass
class FrontCounts:
    """What one front slot has handed to the daemon, over its processes' restarts."""

    served: int = 0  # ModelInfer calls answered
    arena_requests: int = 0  # of which the request came through the arena
    arena_replies: int = 0  # and the reply went back through it
    split: int = 0  # of which the front had split the request


@dataclass
class FrontLink:
    """The daemon's end of one front's socketpair: runs the ModelInfer calls the front hands over."""

    index: int
    infer: InferBytes
    on_lost: Callable[[FrontLink], None]
    transport: asyncio.Transport | None = None
    ready: asyncio.Future[FrontReady] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    calls: dict[int, asyncio.Future[Any]] = field(default_factory=dict)  # tasks, or submitted calls
    traceparents: dict[int, str] = field(default_factory=dict)  # of calls whose INFER comes next
    headers: dict[int, bytes] = field(default_factory=dict)  # the keys the front declared, by id
    counts: FrontCounts = field(default_factory=FrontCounts)
    writer: FrameWriter = field(default_factory=FrameWriter)
    arena: Region | None = None  # requests' views keep it mapped after the front is gone
    arena_id: int | None = None  # its id in `ARENAS`, where workers find it
    submit: Submit | None = None
    _paused: bool = False

    def protocol(self) -> FrontLinkProtocol:
        return FrontLinkProtocol(self._on_frame, self._lost)

    def attach(self, transport: asyncio.Transport) -> None:
        self.transport = self.writer.transport = transport

    def send(self, parts: tuple[Buffer, ...]) -> None:
        self.writer.send(parts)

    def _on_frame(self, kind: int, call_id: int, number: float, payload: bytes | bytearray) -> None:
        if kind in _CALLS:
            deadline = time.monotonic() + number if number >= 0 else None
            try:
                request, chunk = self._request(kind, payload)
            except Internal as exc:
                self.send(frame(Kind.REPLY, call_id, _INTERNAL, exc.message.encode()))
                return
            traceparent = self.traceparents.pop(call_id, None) if self.traceparents else None
            if not (type(request) is SplitRequest and self._submitted(call_id, request, deadline, chunk)):
                self.calls[call_id] = asyncio.get_running_loop().create_task(
                    self._serve(call_id, request, deadline, chunk, traceparent)
                )
            if len(self.calls) >= MAX_IN_FLIGHT and not self._paused and self.transport is not None:
                self._paused = True
                self.transport.pause_reading()
        elif kind == Kind.HEADER:
            if len(self.headers) < MAX_DECLARED or call_id in self.headers:
                self.headers[call_id] = bytes(payload)
        elif kind == Kind.FORGET_HEADERS:
            self.headers.clear()
        elif kind == Kind.CANCEL:
            # Cancelling the task cancels the request's future at once: a batch formed before then copies
            # nothing from it (`marshal.assemble`), so the answer below may free its arena chunk.
            task = self.calls.pop(call_id, None)
            if task is not None:
                task.cancel()
        elif kind == Kind.TRACEPARENT:
            self.traceparents[call_id] = bytes(payload).decode("ascii", "replace")
        elif kind == Kind.READY and not self.ready.done():
            try:
                self.ready.set_result(FrontReady.decode(payload))
            except MalformedMessage as exc:
                self.ready.set_exception(FrontFailed(exc.message))
        elif kind == Kind.FAILED and not self.ready.done():
            self.ready.set_exception(FrontFailed(bytes(payload).decode("utf-8", "replace")))
        else:
            log.warning("unexpected frame from a front", front=self.index, kind=kind)

    def _request(self, kind: int, payload: bytes | bytearray) -> tuple[Request, Chunk | None]:
        """A call's request, as its bytes or as its front split them, and its arena chunk (None when it
        came in the frame). Internal when a reference or a span is malformed or names what is not there:
        the daemon reads nothing outside the frame or the arena, whatever a front sends."""
        if kind == Kind.INFER_SPLIT_SHM and len(payload) == _ONE_RAW_IN_ARENA.size:
            return self._one_raw_in_arena(payload)
        data: bytes | bytearray | memoryview = payload
        found = None
        if kind in _SPLIT:
            found = unpack_spans(payload)
            if found is None:
                raise Internal("malformed request spans")
            data = memoryview(payload)[found[2] :]
        chunk = None
        if kind in _IN_ARENA:
            data, chunk = referenced_request(self.arena, data)
        if found is None:
            return data, chunk
        header_id, spans, _ = found
        return _spanned(split_from_spans(data, self._key(header_id), spans)), chunk

    def _one_raw_in_arena(self, payload: bytes | bytearray) -> tuple[SplitRequest, Chunk]:
        """`_request` for most calls, those of one raw entry in the arena: the spans and the reference read
        in one unpack instead of three steps (2.0 against 3.1 us on the 2-core VM, timeit)."""
        header_id, n, id_start, id_end, raw_start, raw_end, start, length, capacity = (
            _ONE_RAW_IN_ARENA.unpack(payload)
        )
        if n != 1:
            raise Internal("malformed request spans")
        key = self._key(header_id)
        view = arena_view(self.arena, start, length, capacity)
        return _spanned(split_at(view, key, id_start, id_end, (raw_start, raw_end))), Chunk(start, capacity)

    def _key(self, header_id: int) -> bytes:
        key = self.headers.get(header_id)
        if key is None:
            raise Internal(f"request header {header_id} not declared")
        return key

    def _submitted(
        self, call_id: int, request: SplitRequest, deadline: float | None, chunk: Chunk | None
    ) -> bool:
        """Whether the call was taken at once (`submit`): queued, or answered with its error."""
        if self.submit is None:
            return False
        try:
            future = self.submit(request, deadline, partial(self._settled, call_id, chunk))
        except Exception as exc:
            self._count(chunk, split=True)
            self._answer(call_id, self._failure(call_id, exc))
            return True
        if future is None:
            return False
        self.calls[call_id] = future
        return True

    def _settled(self, call_id: int, chunk: Chunk | None, submitted: SubmittedCall) -> None:
        """A submitted call's answer, as `_serve` gives a task's."""
        future = submitted.future
        assert future is not None
        if future.cancelled():
            self._answer(call_id, frame(Kind.REPLY, call_id, _CANCELLED, b"cancelled"))
            return
        error = future.exception()
        if error is None:
            try:  # whatever happens here, the call gets its reply
                reply = self._reply(call_id, submitted.parts(), chunk)
            except Exception as exc:
                reply = self._failure(call_id, exc)
        else:
            reply = self._failure(call_id, error)
        self._count(chunk, split=True)
        self._answer(call_id, reply)

    def _failure(self, call_id: int, error: BaseException) -> tuple[Buffer, ...]:
        if isinstance(error, MpsdError):
            return frame(Kind.REPLY, call_id, grpc_status(error).value[0], error.message.encode())
        log.error("unexpected error in a forwarded request", front=self.index, exc_info=error)
        return frame(Kind.REPLY, call_id, _INTERNAL, f"{type(error).__name__}: {error}".encode())

    def _answer(self, call_id: int, reply: tuple[Buffer, ...]) -> None:
        """Send a call's reply; it no longer counts against MAX_IN_FLIGHT."""
        self.calls.pop(call_id, None)
        if self._paused and len(self.calls) < MAX_IN_FLIGHT // 2 and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        self.send(reply)

    def _count(self, chunk: Chunk | None, split: bool) -> None:
        self.counts.served += 1
        self.counts.arena_requests += chunk is not None
        self.counts.split += split

    async def _serve(
        self,
        call_id: int,
        payload: Request,
        deadline: float | None,
        chunk: Chunk | None,
        traceparent: str | None = None,
    ) -> None:
        """Run one call and answer it, a cancelled one too (the front expects an answer to every call)."""
        try:
            reply = self._reply(call_id, await self.infer(payload, deadline, traceparent), chunk)
            self._count(chunk, split=isinstance(payload, SplitRequest))
        except asyncio.CancelledError:
            reply = frame(Kind.REPLY, call_id, _CANCELLED, b"cancelled")
        except Exception as exc:
            reply = self._failure(call_id, exc)
            self._count(chunk, split=isinstance(payload, SplitRequest))
        self._answer(call_id, reply)

    def _reply(self, call_id: int, parts: Sequence[Buffer], chunk: Chunk | None) -> tuple[Buffer, ...]:
        """A large response goes into the call's chunk when it fits, the rest in the frame."""
        ref = write_reply(self.arena, chunk, parts) if chunk is not None and self.arena is not None else None
        if ref is None:
            return frame_of(Kind.REPLY, call_id, 0, parts)
        self.counts.arena_replies += 1
        return frame(Kind.REPLY_SHM, call_id, 0, ref)

    def _lost(self, exc: Exception | None) -> None:
        for task in list(self.calls.values()):
            task.cancel()
        self.calls.clear()
        if self.arena is not None:
            self.arena.drop_fd()
        if self.arena_id is not None:
            ARENAS.remove(self.arena_id)  # workers that mapped it unmap it
            self.arena_id = None
        self.arena = None  # unmapped once the last request's views of it are gone
        if not self.ready.done():  # (a cancelled wait counts as done)
            self.ready.set_exception(FrontFailed("it closed its connection before it was listening"))
        self.on_lost(self)
