"""A worker's calls to other models, as its channel carries them.

A python model may call other models from inside an execution (`protocol.Call`). The channel knows each
execution it sent (`Caller`: the model version, the chain of model versions its requests came through,
its deadline, whether anybody still waits for it) and hands each call, with its caller, to the handler that
runs it (core's `ModelCalls`, injected: the data plane imports nothing above it). The caller ends when its
execution is answered, when every request in it went away, or with the worker: the handler then fails the
calls still in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from mpsd.errors import Cancelled, MpsdError, Unavailable
from mpsd.ipc import protocol as p
from mpsd.ipc.framing import encode

# A model version as a call chain names it.
Link = tuple[str, int]
Chain = frozenset[Link]


class Caller:
    """One execution that may call other models. `ended` is set (to the error its calls fail with) once
    nobody waits for the execution's answer any more."""

    def __init__(
        self,
        model: str,
        version: int,
        chain: Chain,
        deadline: float | None,
        waiting: Sequence[asyncio.Future[Any]] = (),
    ) -> None:
        self.model = model
        self.version = version
        self.chain = chain
        self.deadline = deadline
        self.ended: asyncio.Future[MpsdError] = asyncio.get_running_loop().create_future()
        self.running = 0  # its calls not answered yet
        self._waiting = waiting
        for future in waiting:
            future.add_done_callback(self._check)

    @property
    def path(self) -> Chain:
        """The model versions a call from this execution comes through: its chain and its own."""
        return self.chain | {(self.model, self.version)}

    def _check(self, _: object) -> None:
        if all(f.done() for f in self._waiting):
            self.end(Cancelled(f"the request to model '{self.model}' that made this call was cancelled"))

    def end(self, error: MpsdError | None) -> None:
        """Its calls in flight fail with `error` (None: there are none, and none can come any more)."""
        for future in self._waiting:
            future.remove_done_callback(self._check)
        if error is not None and not self.ended.done():
            self.ended.set_result(error)


class CallLink:
    """The channel's end of one call: `send` an answer to the worker; `wanted` waits for the worker's
    acknowledgement of the part sent last (False: the model wants no more). Its final answer ends the call
    for its `caller`, before the worker can read it."""

    def __init__(self, call_id: int, send: Callable[[object], None], caller: Caller | None = None) -> None:
        self.call_id = call_id
        self._send = send
        self._caller = caller
        self.acks: asyncio.Queue[bool] = asyncio.Queue()

    def send(self, msg: object) -> None:
        if self._caller is not None and isinstance(msg, p.CallDone | p.CallFailed):
            self._caller.running -= 1
            self._caller = None
        self._send(msg)

    async def wanted(self) -> bool:
        return await self.acks.get()


class CallHandler(Protocol):
    """Runs one call to its end, answering it through `link` (core's `ModelCalls`)."""

    async def __call__(self, call: p.Call, caller: Caller, link: CallLink) -> None: ...


class CallRouter:
    """The calls of one worker: the executions they may come from (a python model's, when a handler is
    given), and the calls running."""

    def __init__(self, handler: CallHandler | None) -> None:
        self.handler = handler
        self.transport: asyncio.Transport | None = None  # the worker's channel, once connected
        self._callers: dict[int, Caller] = {}  # req_id -> its execution, until answered
        self._links: dict[int, CallLink] = {}  # call_id -> the call running
        self._tasks: set[asyncio.Task[None]] = set()

    def _send(self, msg: object) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(encode(msg))

    def begin(
        self,
        req_id: int,
        model: p.ModelSpec,
        chain: Chain,
        deadline: float | None,
        waiting: Sequence[asyncio.Future[Any]],
    ) -> None:
        """An execution sent to the worker: calls may come from it until it is answered."""
        if self.handler is not None:
            self._callers[req_id] = Caller(model.name, model.version, chain, deadline, waiting)

    def answered(self, req_id: int) -> None:
        """The execution is over: its calls still in flight are cancelled."""
        caller = self._callers.pop(req_id, None) if self._callers else None
        if caller is not None:  # the error only where a call waits for it: most executions made none
            why = f"the request to model '{caller.model}' that made this call has ended"
            caller.end(Cancelled(why) if caller.running else None)

    def received(self, msg: p.Call | p.CallAck) -> None:
        if isinstance(msg, p.CallAck):
            link = self._links.get(msg.call_id)
            if link is not None:
                link.acks.put_nowait(not msg.stop)
            return
        caller = self._callers.get(msg.req_id)
        if caller is None or self.handler is None:
            if self.handler is None:
                why = "refused: this daemon runs no calls between models"
            else:
                why = "made while the model loads" if not msg.req_id else "from a request that has ended"
            error = Unavailable(f"call to model '{msg.model}' {why}")
            self._send(p.CallFailed(msg.call_id, error.code.value, error.message))
            return
        caller.running += 1
        link = self._links[msg.call_id] = CallLink(msg.call_id, self._send, caller)
        task = asyncio.ensure_future(self.handler(msg, caller, link))
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._done(t, msg.call_id))

    def _done(self, task: asyncio.Task[None], call_id: int) -> None:
        self._tasks.discard(task)
        self._links.pop(call_id, None)
        if not task.cancelled():
            task.exception()  # the handler answers every error itself: nothing is left to log

    def close(self, error: MpsdError) -> None:
        """The worker is gone: every caller ends, and the calls running stop (nobody is left to answer)."""
        for caller in self._callers.values():
            caller.end(error)
        self._callers.clear()
        for task in list(self._tasks):
            with contextlib.suppress(RuntimeError):  # the loop is closing
                task.cancel()
