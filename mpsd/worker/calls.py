"""Calls from a python model to the repository's other models.

A python model whose `Model.__init__` takes a `models` argument gets a `Models`: `infer` (the outputs),
`infer_async` (an `InFlightCall`: `result()`, or `await` it in an `async def infer`; several in flight at
once) and `stream` (a decoupled model's responses, as an iterator or an async iterator). Each call goes to the
daemon over the worker's socket, tensors inline (`protocol.Call`), and runs there as a request of the
called model: its queue and batching, its load on demand, the memory budget, its checks and errors. The
execution it is made from bounds it: past that execution's deadline, or once nobody waits for it, its calls
fail (`CallError`, with the status a client would get), and calls still in flight when it ends are
cancelled.

Internal API (what a Triton `triton_python_backend_utils` shim builds on): `current()` is the worker's
`Models`; `Models.infer`, `Models.infer_async`, `Models.stream` take `(model, inputs, version=...,
outputs=..., timeout_s=..., request_id=...)`; failures raise `CallError` (`code`: an `ErrorCode`,
`message`: the client's text).
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import AsyncIterator, Generator, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from mpsd.errors import ErrorCode, MpsdError
from mpsd.ipc import protocol as p
from mpsd.ipc.strings import DATATYPE as STRINGS
from mpsd.ipc.strings import serialize
from mpsd.worker.dtypes import TO_TORCH, datatype_of
from mpsd.worker.inbox import Answer, Inbox
from mpsd.worker.strings import Value, as_strings, to_array

Outputs = dict[str, Value]


class CallError(MpsdError):
    """A call that failed: `code` and `message` are what a client calling the model would have got.
    Raised out of `infer`, it fails the calling request with the same status."""

    def __init__(self, code: ErrorCode, message: str, model: str = "") -> None:
        super().__init__(message, code)
        self.model = model


class Models:
    """The repository's models, as a python model calls them (see the module's docstring)."""

    def __init__(self, inbox: Inbox | None, device: torch.device) -> None:
        self._inbox = inbox
        self._device = device
        self._ids = 0

    def infer(
        self,
        model: str,
        inputs: Mapping[str, object],
        version: int | str = "",
        outputs: Sequence[str] = (),
        timeout_s: float | None = None,
        request_id: str = "",
    ) -> Outputs:
        """The model's outputs for `inputs` (torch tensors, numpy arrays, strings as numpy arrays or lists
        of bytes or str), as tensors on this model's device and strings as numpy arrays of bytes."""
        return self.infer_async(model, inputs, version, outputs, timeout_s, request_id).result()

    def infer_async(
        self,
        model: str,
        inputs: Mapping[str, object],
        version: int | str = "",
        outputs: Sequence[str] = (),
        timeout_s: float | None = None,
        request_id: str = "",
    ) -> InFlightCall:
        """Send the call and return at once; its answer is `result()` or `await`ed."""
        return InFlightCall(self._start(model, inputs, version, outputs, timeout_s, request_id, stream=False))

    def stream(
        self,
        model: str,
        inputs: Mapping[str, object],
        version: int | str = "",
        outputs: Sequence[str] = (),
        timeout_s: float | None = None,
        request_id: str = "",
    ) -> Responses:
        """A decoupled model's responses, each as it comes (a model that is not decoupled answers once);
        `close()` (or leaving a `with` block) stops the called model at its next response."""
        return Responses(self._start(model, inputs, version, outputs, timeout_s, request_id, stream=True))

    def _start(
        self,
        model: str,
        inputs: Mapping[str, object],
        version: int | str,
        outputs: Sequence[str],
        timeout_s: float | None,
        request_id: str,
        stream: bool,
    ) -> _Call:
        inbox = self._inbox
        if inbox is None or inbox.closed:
            raise CallError(ErrorCode.UNAVAILABLE, "other models can be called from a serving worker only")
        if not inbox.req_id:
            raise CallError(
                ErrorCode.UNAVAILABLE,
                f"model '{model}' cannot be called while this model loads (its warm-up): calls to other "
                "models are made from requests only",
            )
        tensors = tuple(_call_tensor(name, value) for name, value in inputs.items())
        size = sum(len(t.data) for t in tensors)
        if size > p.MAX_CALL_BYTES:
            raise CallError(
                ErrorCode.RESOURCE_EXHAUSTED,
                f"the call's inputs are {size} bytes; a call carries at most {p.MAX_CALL_BYTES}",
            )
        self._ids += 1
        number = "" if version in ("", -1, None) else str(version)
        timeout_us = 0 if timeout_s is None else max(1, math.ceil(timeout_s * 1e6))
        msg = p.Call(
            self._ids, inbox.req_id, model, number, tensors, tuple(outputs), stream, timeout_us, request_id,
            inbox.trace,
        )  # fmt: skip
        call = _Call(inbox, msg, self._device)
        inbox.calls[msg.call_id] = call
        inbox.send(msg)
        return call


class _Call:
    """One call in flight: the answers delivered so far, and the coroutines waiting for one."""

    def __init__(self, inbox: Inbox, msg: p.Call, device: torch.device) -> None:
        self.inbox = inbox
        self.msg = msg
        self.device = device
        self.answers: deque[Answer] = deque()
        self.ended = False  # CallDone or CallFailed arrived (or the channel closed)
        self.waiters: list[asyncio.Future[None]] = []

    def deliver(self, answer: Answer) -> None:
        self.answers.append(answer)
        if not isinstance(answer, p.CallPart):
            self.ended = True
            self.inbox.calls.pop(self.msg.call_id, None)
        for waiter in self.waiters:
            if not waiter.done():
                waiter.set_result(None)
        self.waiters.clear()

    def lost(self, reason: str) -> None:
        self.deliver(p.CallFailed(self.msg.call_id, ErrorCode.UNAVAILABLE.value, reason))

    def ready(self) -> bool:
        return bool(self.answers)

    def next_answer(self) -> Answer:
        """The next answer, waiting for it on this thread."""
        self.inbox.wait(self.ready)
        return self.answers.popleft()

    async def next_answer_async(self) -> Answer:
        """The next answer; the event loop reads the socket meanwhile, so other coroutines run."""
        if not self.answers:
            waiter = asyncio.get_running_loop().create_future()
            self.waiters.append(waiter)
            with self.inbox.watching(asyncio.get_running_loop()):
                self.inbox.pump()
                if not self.answers:
                    await waiter
        return self.answers.popleft()

    def outputs(self, answer: Answer) -> Outputs:
        """The answer's outputs, or its error raised."""
        if isinstance(answer, p.CallFailed):
            try:
                code = ErrorCode(answer.code)
            except ValueError:
                code = ErrorCode.INTERNAL
            raise CallError(code, answer.message, self.msg.model)
        return {t.name: _value(t, self.device) for t in answer.outputs}

    def stop(self) -> None:
        """Nobody wants more of this call."""
        if not self.ended:
            self.ended = True
            self.inbox.calls.pop(self.msg.call_id, None)
            if not self.inbox.closed:
                self.inbox.send(p.CallAck(self.msg.call_id, stop=True))


class InFlightCall:
    """A call on its way: `result()` waits for its outputs; in a coroutine, `await` it."""

    def __init__(self, call: _Call) -> None:
        self._call = call
        self._answer: Answer | None = None

    def done(self) -> bool:
        return self._answer is not None or self._call.ready()

    def result(self) -> Outputs:
        if self._answer is None:
            self._answer = self._call.next_answer()
        return self._call.outputs(self._answer)

    def __await__(self) -> Generator[Any, None, Outputs]:
        return self._result_async().__await__()

    async def _result_async(self) -> Outputs:
        if self._answer is None:
            self._answer = await self._call.next_answer_async()
        return self._call.outputs(self._answer)


class Responses:
    """A streamed call's responses: iterate (or `async for`); each response taken is acknowledged at once,
    so the next travels while the model works on this one."""

    def __init__(self, call: _Call) -> None:
        self._call = call
        self._finished = False

    def __iter__(self) -> Iterator[Outputs]:
        return self

    def __next__(self) -> Outputs:
        if self._finished:
            raise StopIteration
        return self._take(self._call.next_answer())

    def __aiter__(self) -> AsyncIterator[Outputs]:
        return self

    async def __anext__(self) -> Outputs:
        if self._finished:
            raise StopAsyncIteration
        try:
            return self._take(await self._call.next_answer_async())
        except StopIteration:
            raise StopAsyncIteration from None

    def _take(self, answer: Answer) -> Outputs:
        if isinstance(answer, p.CallPart):
            self._call.inbox.send(p.CallAck(self._call.msg.call_id))
            return self._call.outputs(answer)
        self._finished = True
        if isinstance(answer, p.CallFailed):
            self._call.outputs(answer)  # raises its error
        raise StopIteration

    def close(self) -> None:
        """Stop the call: the called model is stopped at its next response."""
        if not self._finished:
            self._finished = True
            self._call.stop()

    def __enter__(self) -> Responses:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Dropped unfinished: the stop goes out with the worker's next call (or the execution's end stops
        # it). Never sent from here: a collection may run in the middle of another send.
        call = self._call
        if not self._finished and not call.ended:
            call.ended = True
            call.inbox.calls.pop(call.msg.call_id, None)
            call.inbox.stops.append(call.msg.call_id)


def _call_tensor(name: str, value: object) -> p.CallTensor:
    """An input of a call, its bytes inline."""
    if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
        value = torch.from_numpy(value)
    if isinstance(value, torch.Tensor):
        tensor = value.detach().to("cpu").contiguous()
        data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
        return p.CallTensor(name, datatype_of(tensor), tuple(tensor.shape), data)
    array = as_strings(value)
    if array is None:
        raise TypeError(
            f"input '{name}' of a call is a {type(value).__name__}; pass a torch tensor, a numpy array, or "
            "strings as a numpy array or a list of bytes or str"
        )
    return p.CallTensor(name, STRINGS, tuple(array.shape), serialize(array.reshape(-1).tolist()))


def _value(t: p.CallTensor, device: torch.device) -> Value:
    """An output of a call as a model gets an input: strings as a numpy array of bytes, anything else a
    tensor on the model's device."""
    if t.datatype == STRINGS:
        return to_array(t.data, t.shape)
    if not t.data:
        return torch.empty(t.shape, dtype=TO_TORCH[t.datatype], device=device)
    flat = torch.frombuffer(bytearray(t.data), dtype=torch.uint8)  # its own, writable bytes
    tensor = flat.view(TO_TORCH[t.datatype]).reshape(t.shape)
    return tensor if device.type == "cpu" else tensor.to(device)


_current: Models | None = None


def install(models: Models) -> None:
    """Make `models` the worker's (done once, before the model loads)."""
    global _current
    _current = models


def current() -> Models:
    """The worker's `Models` (outside a serving worker: one whose calls fail with the reason)."""
    return _current if _current is not None else Models(None, torch.device("cpu"))
