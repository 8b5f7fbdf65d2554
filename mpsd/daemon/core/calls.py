"""A python model's calls to other models, run in the daemon as requests of the called model.

A call takes the path a client's request takes once it is read: the registry finds the version (loading it
first when it loads on demand, within the memory budget), its inputs are checked against the config with
a client's checks and words (`core.inputs`), and it goes into that version's data plane, to batch with the
model's other traffic. Its answer, or the error a client would get, goes back to the calling worker.

The execution the call comes from bounds it: the call's deadline is that execution's (or the call's own
timeout, when sooner), and once nobody waits for the execution (its clients went away, or it has ended) the
call is cancelled: a queued call is dropped, a stream stops the called model at its next response. A call
that would come back to a model version its request came through (a model calling itself, or a cycle) is
refused: it would wait for the instance that waits for it.

A call from a traced execution is traced too (`core/requests.py`): its span is a child of the execution's,
whose traceparent the worker sends with the call, and the called model's stages are children of it. The
response cache answers a call as it would a client's request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import structlog

from mpsd.daemon.core import requests
from mpsd.daemon.core.ensemble import StepModels
from mpsd.daemon.core.inputs import check_output, named_inputs
from mpsd.daemon.core.model_version import ModelVersion
from mpsd.daemon.core.requests import Stages
from mpsd.daemon.dataplane.calls import Caller, CallLink
from mpsd.daemon.dataplane.request import InferRequest, InputTensor, OutputTensor
from mpsd.daemon.dataplane.tracing import NO_TRACE, RequestTrace
from mpsd.errors import (
    DeadlineExceeded,
    ErrorCode,
    FailedPrecondition,
    MpsdError,
    ResourceExhausted,
    Unimplemented,
)
from mpsd.ipc import protocol as p

log = structlog.get_logger("mpsd.daemon.calls")


class ModelCalls:
    """The data plane's call handler (`dataplane.calls.CallHandler`), on the registry's models."""

    def __init__(self, models: StepModels, stages: Stages | None = None) -> None:
        self.models = models
        self.stages = stages if stages is not None else Stages()  # the response cache, the tracer

    async def __call__(self, call: p.Call, caller: Caller, link: CallLink) -> None:
        try:
            await self._bounded(call, caller, link)
        except MpsdError as exc:
            link.send(p.CallFailed(call.call_id, exc.code.value, exc.message))
        except Exception as exc:  # a fault of the daemon's: the call fails, the daemon goes on
            log.exception("call failed", model=caller.model, called=call.model)
            link.send(p.CallFailed(call.call_id, ErrorCode.INTERNAL.value, f"{type(exc).__name__}: {exc}"))

    async def _bounded(self, call: p.Call, caller: Caller, link: CallLink) -> None:
        """Run the call until it is answered, its deadline passes, or its caller ends."""
        if caller.ended.done():
            raise caller.ended.result()
        limits = requests.Deadline.of(caller.deadline, call.timeout_us)
        deadline = limits.bounded
        past = f"call to model '{call.model}': the deadline of the request to model '{caller.model}' passed"
        if deadline != caller.deadline:
            past = f"call to model '{call.model}': its timeout of {call.timeout_us} us passed"
        if deadline is not None and deadline <= time.monotonic():
            raise DeadlineExceeded(f"{past} before it was made")
        work = asyncio.ensure_future(self._run(call, caller, link, limits))
        try:
            timeout = None if deadline is None else deadline - time.monotonic()
            either: set[asyncio.Future[Any]] = {work, caller.ended}
            await asyncio.wait(either, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
        if not work.cancelled():
            work.result()
            return
        if caller.ended.done():
            raise caller.ended.result()
        raise DeadlineExceeded(past)

    async def _run(self, call: p.Call, caller: Caller, link: CallLink, limits: requests.Deadline) -> None:
        # A traced execution's call: a span under the execution's (`call.trace`), its stages under it.
        # An untraced one's (no traceparent) is NO_TRACE without asking the tracer, as an adapter's is.
        tracer = self.stages.tracer
        trace = (
            tracer.continued(call.model, call.version, call.request_id, call.trace, "call")
            if call.trace
            else NO_TRACE
        )
        try:
            mv = await self.stages.acquire(self.models, call.model, call.version, limits.bounded, trace)
            try:
                with trace.stage("checks"):
                    request = self._request(call, mv, caller, trace.carried)
                await self._answer(call, mv, request, limits.queue(request, mv.config), link)
            finally:
                self.models.touch(call.model)
        except BaseException as exc:
            trace.end(exc)
            raise
        trace.end()

    async def _answer(
        self, call: p.Call, mv: ModelVersion, request: InferRequest, deadline: float | None, link: CallLink
    ) -> None:
        decoupled = mv.config.model_transaction_policy.decoupled
        if decoupled and call.stream:
            await self._stream(call, mv, request, deadline, link)
            return
        if decoupled:
            raise Unimplemented(
                f"model '{mv.name}' is decoupled (it answers with a stream of responses): call it with "
                "models.stream"
            )
        result = await self.stages.infer(mv, request, deadline)
        outputs = _tensors(result.outputs)
        if not call.stream:
            link.send(p.CallDone(call.call_id, outputs))
        else:  # a model that is not decoupled streams its one answer
            link.send(p.CallPart(call.call_id, outputs))
            if await link.wanted():
                link.send(p.CallDone(call.call_id))

    async def _stream(
        self, call: p.Call, mv: ModelVersion, request: InferRequest, deadline: float | None, link: CallLink
    ) -> None:
        """Each response as the called model yields it, the next only once the caller took this one (the
        version's own stream holds a few more back); the caller's stop stops the called model."""
        responses = mv.plane.stream(request, deadline)
        try:
            async for result in responses:
                link.send(p.CallPart(call.call_id, _tensors(result.outputs)))
                self.models.touch(call.model)
                if not await link.wanted():
                    return
        finally:
            await responses.aclose()
        link.send(p.CallDone(call.call_id))

    def _request(
        self, call: p.Call, mv: ModelVersion, caller: Caller, trace: RequestTrace | None
    ) -> InferRequest:
        """The call as a request of `mv`, checked as a client's would be; refused when it comes back to a
        model version its request came through."""
        path = caller.path
        if (mv.name, mv.version) in path:
            if (mv.name, mv.version) == (caller.model, caller.version):
                what = "itself"
            else:
                what = f"model '{mv.name}' version {mv.version}, which its request came through"
            way = ", ".join(f"'{name}' version {version}" for name, version in sorted(path))
            raise FailedPrecondition(
                f"model '{caller.model}' version {caller.version} called {what} (the request came through "
                f"{way}): a call may not come back to a model version on its way, which would wait for "
                "itself"
            )
        config = mv.config
        inputs, batch = named_inputs(
            mv.name, config, [InputTensor(t.name, t.datatype, t.shape, t.data) for t in call.inputs]
        )
        known = config.output_by_name
        named: list[str] = []
        for name in call.outputs:
            check_output(mv.name, name, known, named)
            named.append(name)
        return requests.from_call(
            config, mv.name, mv.version, call.request_id, inputs, tuple(named) or tuple(known), batch,
            call.timeout_us, path, trace,
        )  # fmt: skip


def _tensors(outputs: Sequence[OutputTensor]) -> tuple[p.CallTensor, ...]:
    """An answer's outputs, inline; refused beyond what a call carries."""
    size = sum(len(o.data) for o in outputs)
    if size > p.MAX_CALL_BYTES:
        raise ResourceExhausted(
            f"the call's outputs are {size} bytes; a call carries at most {p.MAX_CALL_BYTES} bytes inline"
        )
    return tuple(p.CallTensor(o.name, o.datatype, o.shape, o.data) for o in outputs)
