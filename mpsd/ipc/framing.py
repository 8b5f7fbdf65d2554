"""Length-prefixed framing of protocol messages on a stream socket, blocking (worker) and asyncio (daemon).

Messages are small dataclasses from `mpsd.ipc.protocol`; both ends are processes of the same installation,
so the per-request ones have a fixed binary layout and the rest are pickled (`mpsd.ipc.wire_codec`). Tensor
bytes travel this way only in a python model's calls to other models (`protocol.Call`).
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Callable
from typing import cast

from mpsd.ipc.wire_codec import dumps, loads

_HEADER = struct.Struct("!I")
MAX_MESSAGE = 64 * 1024 * 1024


class ConnectionClosed(EOFError):
    """The other end went away (process exit or socket closed)."""


def encode(message: object) -> bytes:
    payload = dumps(message)
    return _HEADER.pack(len(payload)) + payload


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionClosed("peer closed the connection")
        got += k
    return bytes(buf)


def send_blocking(sock: socket.socket, message: object) -> None:
    """Not thread-safe, and needs no lock: one thread writes each socket (a worker's heartbeats have a
    socket of their own)."""
    sock.sendall(encode(message))


def recv_blocking(sock: socket.socket) -> object:
    (length,) = _HEADER.unpack(_recv_exactly(sock, _HEADER.size))
    if length > MAX_MESSAGE:
        raise ConnectionClosed(f"message of {length} bytes exceeds the protocol limit")
    return loads(_recv_exactly(sock, length))


class FrameReader:
    """The worker's receiving end: one `recv` system call per message in the common case, where
    `recv_blocking` makes two plus a `select`.

    Bytes are read into a reusable buffer that may hold several messages; a receive timeout (SO_RCVTIMEO,
    set once) lets the caller do periodic work while idle without polling first.
    """

    BUFFER = 64 * 1024

    def __init__(self, sock: socket.socket, timeout_s: float) -> None:
        self._sock = sock
        self._buf = bytearray(self.BUFFER)
        self._view = memoryview(self._buf)
        self._start = self._end = 0
        seconds = int(timeout_s)
        micros = max(int((timeout_s - seconds) * 1e6), 0 if seconds else 1)  # all zeros: no timeout at all
        # struct timeval: a 64-bit tv_sec then tv_usec (a 64-bit long on Linux, a 32-bit int plus padding
        # on macOS: the same bytes on little-endian machines).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("qq", seconds, micros))

    def _fill(self, flags: int = 0) -> bool:
        """Read what is available; False when the timeout passed (or, with MSG_DONTWAIT, nothing was
        there) with nothing read."""
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):  # compact: the partial message moves to the front
            pending = self._end - self._start
            self._buf[:pending] = self._view[self._start : self._end]
            self._start, self._end = 0, pending
        try:
            n = self._sock.recv_into(self._view[self._end :], 0, flags)
        except (BlockingIOError, TimeoutError):
            return False
        if n == 0:
            raise ConnectionClosed("peer closed the connection")
        self._end += n
        return True

    def recv(self) -> object | None:
        """The next message, or None when none arrived within the timeout."""
        while self._end - self._start < _HEADER.size:
            if not self._fill():
                return None
        (length,) = _HEADER.unpack_from(self._buf, self._start)
        if length > MAX_MESSAGE:
            raise ConnectionClosed(f"message of {length} bytes exceeds the protocol limit")
        body = self._start + _HEADER.size
        if body + length <= self._end:
            self._start = body + length
            message: object = loads(self._view[body : body + length])
            return message
        # A message larger than what is buffered: the rest is read straight into a buffer of its own.
        have = self._end - body
        whole = bytearray(length)
        whole[:have] = self._view[body : self._end]
        self._start = self._end = 0
        view = memoryview(whole)
        while have < length:
            try:
                k = self._sock.recv_into(view[have:])
            except (BlockingIOError, TimeoutError):
                continue  # mid-message: the rest is on its way
            if k == 0:
                raise ConnectionClosed("peer closed the connection")
            have += k
        message = loads(whole)
        return message

    def _whole(self) -> bool:
        """A whole message is in the buffer."""
        if self._end - self._start < _HEADER.size:
            return False
        (length,) = _HEADER.unpack_from(self._buf, self._start)
        return bool(self._start + _HEADER.size + length <= self._end)

    def poll(self) -> object | None:
        """The next message if it is here whole (buffered, or in the socket already), without waiting;
        else None, and what did arrive stays buffered for `recv`. A message larger than the buffer is
        only ever read by `recv`."""
        if self._whole():
            return self.recv()
        if self._end - self._start >= _HEADER.size:
            (length,) = _HEADER.unpack_from(self._buf, self._start)
            if _HEADER.size + length > len(self._buf):
                return None
        if not self._fill(socket.MSG_DONTWAIT) or not self._whole():
            return None
        return self.recv()

    def take(self) -> object | None:
        """The next message if any of it has arrived (its rest, on its way, is waited for), else None at
        once: what an event loop's reader callback reads, large messages included."""
        if self._start == self._end and not self._fill(socket.MSG_DONTWAIT):
            return None
        return self.recv_wait()

    def recv_wait(self) -> object:
        """The next message, however long it takes."""
        while (message := self.recv()) is None:
            pass
        return message


class FrameProtocol(asyncio.BufferedProtocol):
    """The daemon's receiving end: frames are cut out of the socket's bytes as they arrive and handed to
    `on_message` within the same event-loop callback (no reader task to wake per message)."""

    BUFFER = 64 * 1024

    def __init__(
        self, on_message: Callable[[object], None], on_closed: Callable[[Exception | None], None]
    ) -> None:
        self.on_message = on_message
        self.on_closed = on_closed
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray(self.BUFFER)
        self._view = memoryview(self._buf)
        self._start = self._end = 0
        self._big: bytearray | None = None  # a message larger than the buffer, being filled
        self._big_have = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass it

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._big is not None:
            return memoryview(self._big)[self._big_have :]
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):
            pending = self._end - self._start
            self._buf[:pending] = self._view[self._start : self._end]
            self._start, self._end = 0, pending
        return self._view[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._big is not None:
            self._big_have += nbytes
            if self._big_have < len(self._big):
                return
            whole, self._big = self._big, None
            self.on_message(loads(whole))
            return
        self._end += nbytes
        while self._end - self._start >= _HEADER.size:
            (length,) = _HEADER.unpack_from(self._buf, self._start)
            if length > MAX_MESSAGE:
                assert self.transport is not None
                self.transport.abort()  # connection_lost reports it
                return
            body = self._start + _HEADER.size
            if body + length > self._end:
                if length > len(self._buf) - _HEADER.size:  # cannot fit even after compaction
                    have = self._end - body
                    self._big = bytearray(length)
                    self._big[:have] = self._view[body : self._end]
                    self._big_have = have
                    self._start = self._end = 0
                return
            self._start = body + length
            self.on_message(loads(self._view[body : body + length]))

    def connection_lost(self, exc: Exception | None) -> None:
        self.on_closed(exc)
