"""Length-prefixed framing of protocol messages on a stream socket, blocking (worker) and asyncio (daemon).

Messages are small dataclasses from `mpsd.ipc.protocol`; both ends are processes of the same installation,
so pickle is used for speed. Tensor bytes never travel this way.
"""

from __future__ import annotations

import asyncio
import pickle
import socket
import struct
import threading

_HEADER = struct.Struct("!I")
MAX_MESSAGE = 64 * 1024 * 1024


class ConnectionClosed(EOFError):
    """The other end went away (process exit or socket closed)."""


def encode(message: object) -> bytes:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
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


_send_lock = threading.Lock()


def send_blocking(sock: socket.socket, message: object) -> None:
    """Thread-safe: a worker's heartbeat thread and its main thread share one socket."""
    data = encode(message)
    with _send_lock:
        sock.sendall(data)


def recv_blocking(sock: socket.socket) -> object:
    (length,) = _HEADER.unpack(_recv_exactly(sock, _HEADER.size))
    if length > MAX_MESSAGE:
        raise ConnectionClosed(f"message of {length} bytes exceeds the protocol limit")
    return pickle.loads(_recv_exactly(sock, length))


async def recv_async(reader: asyncio.StreamReader) -> object:
    try:
        header = await reader.readexactly(_HEADER.size)
        (length,) = _HEADER.unpack(header)
        if length > MAX_MESSAGE:
            raise ConnectionClosed(f"message of {length} bytes exceeds the protocol limit")
        return pickle.loads(await reader.readexactly(length))
    except asyncio.IncompleteReadError:
        raise ConnectionClosed("peer closed the connection") from None
