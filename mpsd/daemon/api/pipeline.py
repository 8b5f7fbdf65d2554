"""The inference operations, whatever the protocol that asked for them: a call checked against its model,
run through the model version's data plane (or the response cache), and its outputs written to the client's
shared memory; a decoupled model's responses as a stream.

This is the request path's stop in the adapters' layer; the management operations (health, metadata,
repository, shared-memory registration, settings) are `operations.py`'s, whose `Operations` inherits
these, so both protocols' adapters reach them through one object.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from itertools import chain

from mpsd.config.model_config import ModelConfig
from mpsd.daemon.api.call import InferCall, InputCall, OutputCall
from mpsd.daemon.api.classification import classify, requested
from mpsd.daemon.api.client_shm import SHM_PARAMS, ClientShmRegistry, ShmLease
from mpsd.daemon.api.parse import call_deadline, check_name, parse_infer_request
from mpsd.daemon.api.tracing import Incoming, Tracing
from mpsd.daemon.core.model_version import ModelVersion
from mpsd.daemon.core.registry import Registry
from mpsd.daemon.core.requests import Deadline, Stages
from mpsd.daemon.dataplane.plane import Then
from mpsd.daemon.dataplane.request import InferRequest, InferResult
from mpsd.daemon.dataplane.tracing import NO_TRACE, Trace
from mpsd.errors import MpsdError, Unimplemented

Responses = AsyncGenerator["Answered", None]  # a decoupled model's to one call


@dataclass(frozen=True)
class Answered:
    """An inference's result, and the outputs that went to the client's shared memory instead."""

    result: InferResult
    in_shm: frozenset[str]
    trace: Trace = NO_TRACE  # the request's: the adapter ends it with its answer (`trace.answering()`)


def _classes(call: InferCall) -> dict[str, int]:
    """The outputs a call asks classes of (`classification.py`, Triton's extension), read only when an
    output has parameters at all: nearly no call has, and then the extension is not entered."""
    return requested(call) if any(out.parameters for out in call.outputs) else {}


def _names_shm(call: InferCall) -> bool:
    """Whether a tensor of the call names a place in a client's shared memory: nearly no call does, and
    then no lease of the registered regions is taken."""
    tensors: Iterable[InputCall | OutputCall] = chain(call.inputs, call.outputs)
    return any(t.parameters and not SHM_PARAMS.isdisjoint(t.parameters) for t in tensors)


def _bound(
    mv: ModelVersion, bind: Callable[[ModelConfig], InferRequest | None], deadline: float | None
) -> tuple[InferRequest, float | None] | None:
    """A checked request bound under the version's config, and the deadline it queues with (None: it does
    not bind)."""
    parsed = bind(mv.config)
    if parsed is None:
        return None
    queued = deadline  # a request without a timeout of its own queues with the client's deadline
    if parsed.timeout_us:
        queued = Deadline.of(deadline, parsed.timeout_us).queue(parsed, mv.config)
    return parsed, queued


def _written(shm: ShmLease | None, result: InferResult) -> frozenset[str]:
    """Write the outputs bound to the client's shared memory; the names of those written there."""
    if shm is None:
        return frozenset()
    shm.write_outputs(result.outputs)
    return frozenset(shm.outputs)


class Pipeline:
    """Inference: what `Operations` (`operations.py`) does with a request to run a model."""

    # The operations', set by `Operations.__init__`.
    registry: Registry
    tracing: Tracing
    stages: Stages  # the registry's: the response cache, shared with models' calls and ensembles' steps
    client_shm: ClientShmRegistry

    async def infer(
        self,
        call: InferCall,
        deadline: float | None = None,
        learn: Callable[[InferRequest, ModelConfig], None] | None = None,
        came: Incoming | None = None,
    ) -> Answered:
        """Check a call against its model, run it, and write the outputs bound to shared memory. `learn` is
        told what the call became, and against which config, once it passed its checks. `came`: tracing is
        on, and this is what the adapter knows of the request's trace."""
        check_name("model", call.model)
        trace = NO_TRACE if came is None else self.tracing.begin_call(call, came)
        try:
            limits = call_deadline(call, deadline)
            mv = await self.stages.acquire(self.registry, call.model, call.version, limits.bounded, trace)
            if mv.config.model_transaction_policy.decoupled:
                raise Unimplemented(
                    f"model '{mv.name}' is decoupled (it answers with a stream of responses): call it with "
                    "ModelStreamInfer, or over HTTP with /generate_stream or /generate"
                )
            try:
                with self._lease(call) as shm:  # regions the request names stay open until answered
                    with trace.stage("checks"):
                        parsed = parse_infer_request(call, mv.config, shm, trace.carried)
                    if parsed.sequence is not None and not parsed.sequence.start:
                        mv = self._continuing(mv, parsed)
                    if learn is not None and not self.stages.caches(parsed):  # a cached one: never known
                        learn(parsed, mv.config)
                    result = await self.stages.infer(mv, parsed, limits.queue(parsed, mv.config))
                    wanted = _classes(call)
                    if wanted:
                        result = classify(result, wanted, mv.config.max_batch_size > 0, mv.labels)
                    return Answered(result, _written(shm, result), trace)
            finally:
                self.registry.touch(call.model)
        except BaseException as exc:
            trace.end(exc)
            raise

    def _lease(self, call: InferCall) -> AbstractContextManager[ShmLease | None]:
        """The client's regions the call names, held until it is answered (None: it names none)."""
        return self.client_shm.lease() if _names_shm(call) else nullcontext()

    def _continuing(self, mv: ModelVersion, request: InferRequest) -> ModelVersion:
        """Where a request of a live sequence goes: a replaced version still draining holds it, or `mv`."""
        entry = self.registry.entries.get(mv.name)
        return entry.continuing(mv, request) if entry is not None and entry.retiring else mv

    async def infer_checked(
        self,
        model: str,
        version: str,
        bind: Callable[[ModelConfig], InferRequest | None],
        deadline: float | None,
    ) -> Answered | None:
        """Run a request that passed its checks before: `bind` makes it for the model's config now, or says
        None (the config changed, or the bytes do not fit), and the caller then takes the full path, which
        also reports what is wrong. A model that runs is not even looked up again in the repository."""
        registry = self.registry
        if registry.loads_first(model):
            mv = await registry.acquire(model, version, deadline)
        else:
            mv = registry.acquire_running(model, version)
        try:
            bound = _bound(mv, bind, deadline)
            if bound is None:
                return None
            return Answered(await mv.plane.infer(*bound), frozenset())
        finally:
            self.registry.touch(model)

    def submit_checked(
        self,
        model: str,
        version: str,
        bind: Callable[[ModelConfig], InferRequest | None],
        deadline: float | None,
        then: Then,
    ) -> asyncio.Future[InferResult] | None:
        """`infer_checked` without a coroutine, for a caller that takes many requests in one callback: the
        request submitted to its version's plane (`VersionPlane.submit`), whose future gets its result and
        is handed to `then`. None where the caller must take `infer_checked` or the full path: the model
        must load first, its config changed, or the bytes do not fit."""
        if self.registry.loads_first(model):
            return None
        mv = self.registry.acquire_running(model, version)  # the model's last use is now
        bound = _bound(mv, bind, deadline)
        return None if bound is None else mv.plane.submit(*bound, then)

    def decoupled(self, name: str, version: str) -> bool:
        """Whether the model answers with a stream of responses (False for a model not known: its request
        goes the unary way and gets the unary way's error)."""
        entry = self.registry.entries.get(name)
        source = entry.source if entry is not None else None
        if entry is not None and entry.versions:
            try:
                return self.registry.route(name, version).config.model_transaction_policy.decoupled
            except MpsdError:
                return False
        return bool(source and source.config and source.config.model_transaction_policy.decoupled)

    def stream(
        self, call: InferCall, deadline: float | None = None, came: Incoming | None = None
    ) -> Responses:
        """A decoupled model's responses to one call as it yields them, each writing the outputs bound to
        shared memory; closing the iterator stops the model at its next. A traced call's are each a span."""
        trace = NO_TRACE if came is None else self.tracing.begin_call(call, came)
        return trace.responses(self._stream(call, deadline, trace))

    def answers(self, call: InferCall, decoupled: bool, came: Incoming | None = None) -> Responses:
        """The responses to a call as a stream, whatever the model: a decoupled model's as it yields them,
        an ordinary model's one (the adapters that answer both ways: /generate, OpenAI's API)."""
        return self.stream(call, came=came) if decoupled else self._once(call, came)

    async def _once(self, call: InferCall, came: Incoming | None) -> Responses:
        answered = await self.infer(call, came=came)
        with answered.trace.answering():
            yield answered

    async def _stream(self, call: InferCall, deadline: float | None, trace: Trace) -> Responses:
        check_name("model", call.model)
        limits = call_deadline(call, deadline)
        mv = await self.stages.acquire(self.registry, call.model, call.version, limits.bounded, trace)
        try:
            with self._lease(call) as shm:
                with trace.stage("checks"):
                    parsed = parse_infer_request(call, mv.config, shm, trace.carried)
                if parsed.sequence is not None and not parsed.sequence.start:
                    mv = self._continuing(mv, parsed)
                wanted = _classes(call)
                responses = mv.plane.stream(parsed, limits.queue(parsed, mv.config))
                try:
                    async for result in responses:
                        if wanted:
                            result = classify(result, wanted, mv.config.max_batch_size > 0, mv.labels)
                        yield Answered(result, _written(shm, result))
                        self.registry.touch(call.model)
                finally:
                    await responses.aclose()
        finally:
            self.registry.touch(call.model)
