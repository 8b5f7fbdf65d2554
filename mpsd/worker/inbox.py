"""The daemon's messages to this worker, as its one thread reads them.

A python model may wait, inside an execution, for the answers to its calls to other models
(`mpsd.worker.calls`); meanwhile the daemon goes on sending (the next execution, an output region, a stream
part's acknowledgement). Whoever reads the socket reads through this inbox: call answers go to their calls
as they arrive, every other message to the serving loop, at once or, read while a call waited, through
`early`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import deque
from collections.abc import Callable, Iterator
from typing import Protocol

from mpsd.ipc import protocol as p
from mpsd.ipc.framing import ConnectionClosed, FrameReader, send_blocking

Answer = p.CallPart | p.CallDone | p.CallFailed


class Waiting(Protocol):
    """A call in flight, as the inbox sees it."""

    def deliver(self, answer: Answer) -> None: ...

    def lost(self, reason: str) -> None: ...


class Inbox:
    """`req_id` is the execution in progress, which the model's calls are made from (0: none, while the
    worker loads)."""

    def __init__(self, sock: socket.socket, reader: FrameReader) -> None:
        self.sock = sock
        self.reader = reader
        self.early: deque[object] = deque()
        self.calls: dict[int, Waiting] = {}
        self.req_id = 0
        self.trace = ""  # that execution's span as a traceparent, for its calls ("": not traced)
        self.closed = False
        self.stops: list[int] = []  # streams dropped without `close`: their stop goes with the next send
        self._watchers = 0

    # ---- the serving loop's reads: the next message that is not a call's answer ---------------------

    def recv(self) -> object | None:
        """The next message, or None when none arrived within the reader's timeout."""
        while (msg := self._read(self.reader.recv)) is not None and self._route(msg):
            pass
        return msg

    def poll(self) -> object | None:
        """The next message if it is here, without waiting."""
        while (msg := self._read(self.reader.poll)) is not None and self._route(msg):
            pass
        return msg

    def recv_wait(self) -> object:
        """The next message, however long it takes."""
        while self._route(msg := self._read(self.reader.recv_wait)):
            pass
        return msg

    # ---- the calls' side -------------------------------------------------------------------------

    def send(self, msg: object) -> None:
        for call_id in self.stops:
            send_blocking(self.sock, p.CallAck(call_id, stop=True))
        self.stops.clear()
        send_blocking(self.sock, msg)

    def wait(self, ready: Callable[[], bool]) -> None:
        """Read until `ready()`: the answers of any call are delivered, other messages kept for later."""
        while not ready():
            msg = self._read(self.reader.recv_wait)
            if not self._route(msg):
                self.early.append(msg)

    def pump(self) -> None:
        """Read whatever has arrived, without waiting for more (an event loop's reader callback)."""
        with contextlib.suppress(ConnectionClosed):  # every call in flight has failed with the reason
            while (msg := self._read(self.reader.take)) is not None:
                if not self._route(msg):
                    self.early.append(msg)

    @contextlib.contextmanager
    def watching(self, loop: asyncio.AbstractEventLoop) -> Iterator[None]:
        """While a coroutine awaits a call: `loop` reads the socket when it becomes readable."""
        fd = self.sock.fileno()
        if self._watchers == 0:
            loop.add_reader(fd, self.pump)
        self._watchers += 1
        try:
            yield
        finally:
            self._watchers -= 1
            if self._watchers == 0:
                loop.remove_reader(fd)

    def _read(self, read: Callable[[], object | None]) -> object | None:
        try:
            return read()
        except ConnectionClosed:
            self.closed = True
            for call in list(self.calls.values()):
                call.lost("the daemon closed the worker's channel")
            self.calls.clear()
            raise

    def _route(self, msg: object) -> bool:
        """Deliver a call's answer (True), or say it is for the serving loop (False)."""
        if not isinstance(msg, (p.CallPart, p.CallDone, p.CallFailed)):
            return False
        call = self.calls.get(msg.call_id)
        if call is not None:  # else a call the model dropped: nobody wants its answer
            call.deliver(msg)
        return True
