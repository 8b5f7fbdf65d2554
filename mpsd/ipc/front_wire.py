"""Frames between a front process and the daemon on their socketpair.

A front hands each ModelInfer call to the daemon as the request's serialized bytes, with where its
tensor bytes and id are, and gets back the serialized response or a status: the front never decodes
protobuf on this path, the daemon never runs gRPC for it. The header is fixed-size binary (not pickle)
because it is paid once per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import socket
import struct
from collections.abc import Callable, Iterable, Sequence
from typing import cast

# kind, call id, a number (request: seconds left before the client's deadline, < 0 for none;
# response: gRPC status code), payload length.
HEADER = struct.Struct("!BQdI")
MAX_PAYLOAD = 2**32 - 1
# A payload at least this large is read straight into its own buffer instead of the shared one.
# ModelInfer calls one front may have in the daemon at once (both ends hold to it).
MAX_IN_FLIGHT = 4096
_DIRECT = 32 * 1024
_SCRATCH = 64 * 1024


class Kind(enum.IntEnum):
    CONFIG = 1  # daemon -> front: the front's settings (JSON), the first frame
    READY = 2  # front -> daemon: listening (payload: JSON with the front's pid)
    FAILED = 3  # front -> daemon: could not start (payload: the reason)
    INFER = 4  # front -> daemon: a ModelInfer call (number: seconds left, payload: request bytes)
    CANCEL = 5  # front -> daemon: the client went away; drop the call
    REPLY = 6  # daemon -> front: number 0 and response bytes, or a status code and a message (every call
    # gets one, a cancelled one too: only then may the front reuse the call's arena chunk)
    LOG_LEVEL = 7  # daemon -> front: the daemon's log level changed (payload: its name)
    INFER_SHM = 8  # front -> daemon: a ModelInfer call, its request in the arena (payload: arena.INFER_REF)
    REPLY_SHM = 9  # daemon -> front: the response, at the start of the chunk (payload: arena.REPLY_REF)
    AUTH = 10  # daemon -> front: SIGHUP re-read the access settings (payload: auth, tokens, TLS as JSON)
    TRACEPARENT = 11  # front -> daemon: the call's W3C traceparent (payload), just before its INFER frame
    HEADER = 12  # front -> daemon: a request key (payload) that later INFER_SPLIT frames name by this id
    # (the call id field); `infer_wire.split_spans`
    FORGET_HEADERS = 13  # front -> daemon: the ids declared before this frame are no longer used
    INFER_SPLIT = 14  # front -> daemon: INFER with the request split by the front: its header's id and the
    # spans of its id and raw entries (`infer_wire.Spans.pack`), then the request bytes
    INFER_SPLIT_SHM = 15  # front -> daemon: INFER_SHM so split: the spans, then arena.INFER_REF


# Socket buffer of each end: a frame of a few MiB (a 600 KB image and its reply) goes in one system call
# instead of one per default-sized buffer (about 200 KiB on Linux, 8 KiB on macOS), each a wake-up of the
# other process. The kernel caps it (Linux: net.core.wmem_max and rmem_max).
SOCKET_BUFFER = 4 * 1024 * 1024


Buffer = bytes | bytearray | memoryview


def nbytes(piece: bytes | bytearray | memoryview) -> int:
    """Bytes, not items: `len` of a memoryview counts elements of its format."""
    return piece.nbytes if type(piece) is memoryview else len(piece)  # memoryview has no subclasses


def total_nbytes(pieces: Iterable[Buffer]) -> int:
    """`nbytes` of all the pieces, in one loop (this runs for every request and reply)."""
    total = 0
    for piece in pieces:
        total += piece.nbytes if type(piece) is memoryview else len(piece)
    return total


def frame(kind: Kind, call_id: int = 0, number: float = 0.0, payload: Buffer = b"") -> tuple[Buffer, ...]:
    """A frame as its parts: the payload is not copied behind the header; the writer hands both to one
    scatter-gather send."""
    return frame_of(kind, call_id, number, (payload,))


def frame_of(kind: Kind, call_id: int, number: float, pieces: Sequence[Buffer]) -> tuple[Buffer, ...]:
    """A frame whose payload is `pieces` back to back. Empty pieces are left out: asyncio's scatter-gather
    `writelines` (Python 3.12+) never drops an empty buffer at the end of its queue, and would then poll a
    writable socket without end."""
    kept: list[Buffer] = []
    size = 0
    for piece in pieces:
        n = piece.nbytes if type(piece) is memoryview else len(piece)
        if n:
            kept.append(piece)
            size += n
    return (HEADER.pack(kind, call_id, number, size), *kept)


def widen_buffers(sock: socket.socket) -> int:
    """Ask for SOCKET_BUFFER each way; a smaller cap from the kernel is kept (frames still flow). Returns
    the send buffer granted, as the kernel reports it (Linux reports twice what it uses for data)."""
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)
    return int(sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF))


Handler = Callable[[int, int, float, bytes | bytearray], None]


class FrameWriter:
    """Frames written in one event-loop iteration leave in one send: under load, one system call (and
    one wake-up of the other process) carries many requests or replies instead of one each."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._pending: list[Buffer] = []

    def send(self, parts: tuple[Buffer, ...]) -> None:
        """Queue one frame (see `frame`)."""
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.extend(parts)

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        if self.transport is not None and not self.transport.is_closing():
            self.transport.writelines(pending)


class FrontLinkProtocol(asyncio.BufferedProtocol):
    """Splits the byte stream into frames and calls `on_frame(kind, call_id, number, payload)`.

    Small frames are cut out of one reusable buffer; a large payload (an image, a big tensor) gets a
    buffer of its exact size that the socket reads into directly, so it is copied once on arrival.
    """

    def __init__(self, on_frame: Handler, on_lost: Callable[[Exception | None], None]) -> None:
        self._on_frame = on_frame
        self._on_lost = on_lost
        self._buf = bytearray(_SCRATCH)  # never resized, so one view of it serves every read and slice
        self._view = memoryview(self._buf)
        self._start = 0  # first unparsed byte in _buf
        self._end = 0  # end of received bytes in _buf
        self._big: bytearray | None = None  # payload being read directly
        self._big_got = 0
        self._big_header: tuple[int, int, float] = (0, 0, 0.0)
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass it

    def connection_lost(self, exc: Exception | None) -> None:
        self._on_lost(exc)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._big is not None:
            return memoryview(self._big)[self._big_got :]
        if self._end == len(self._buf):
            self._compact()
        return self._view[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._big is not None:
            self._big_got += nbytes
            if self._big_got == len(self._big):
                kind, call_id, number = self._big_header
                payload, self._big = self._big, None
                self._on_frame(kind, call_id, number, payload)
            return
        self._end += nbytes
        self._parse()

    def _compact(self) -> None:
        """Move the unparsed tail to the front. It is always shorter than the buffer: a frame that would
        not fit (_DIRECT or more) leaves for its own buffer as soon as its header is parsed."""
        pending = self._end - self._start
        self._view[:pending] = self._view[self._start : self._end]
        self._start, self._end = 0, pending

    def _parse(self) -> None:
        buf = self._view
        while self._end - self._start >= HEADER.size:
            kind, call_id, number, length = HEADER.unpack_from(buf, self._start)
            body = self._start + HEADER.size
            have = self._end - body
            if have >= length:
                payload = bytes(buf[body : body + length])
                self._start = body + length
                self._on_frame(kind, call_id, number, payload)
                continue
            if length >= _DIRECT:
                big = bytearray(length)
                big[:have] = buf[body : self._end]
                self._start = self._end = 0
                self._big, self._big_got, self._big_header = big, have, (kind, call_id, number)
            break
        if self._start == self._end:
            self._start = self._end = 0
