"""Every request the data plane runs is built here, one factory per source, by one set of rules.

A request reaches a version's plane from four places: a client's call, checked against the model
(`from_client`: gRPC, HTTP, OpenAI's API and /generate all read their request into one call first), a
ModelInfer whose header was checked before (the request `from_client` built for the header's first call,
kept without its bytes by `api.grpc.known_headers`, with this call's id and bytes), a python model's call
to another model (`from_call`) and an ensemble's step (`for_step`). Each source says what it can in
`Terms`, and `_build` alone decides what the request carries:

- priority and timeout: the request's own; a step's are its ensemble request's, as in Triton; a model's
  call has neither (the worker's call API carries only its timeout), so it has the model's default level;
- parameters: the model's own ones (never the server's `priority`, `timeout`, sequence and the other
  REQUEST_PARAMS, which the server reads itself) reach a model that reads them: a python model, or an
  ensemble, which passes them on to its steps; any other model gets none;
- the deadline it queues with (`Deadline.queue`): the earlier of the one of whoever waits for it and its
  timeout counted from its arrival, or only the former where its priority level lets its timeout override
  the level's (the queue then applies the timeout with the level's action);
- its trace (`trace`): a traced request's spans, given by its source (`Stages`, below);
- response cache eligibility (`cacheable`): the model enables the cache, answers once (not decoupled),
  and the request is no sequence's step and has no input or output in a client's shared memory.

Once built, every request passes the same stages on its way to its version's plane (`Stages`): the wait
for a load on demand, the response cache, and its trace. A request's trace is a value that is always there
(`dataplane.tracing.Trace`): a `RequestTrace` whose stages are spans, or `NO_TRACE`, whose stages do
nothing, so traced and untraced requests run one path. Which requests are traced is the trace settings'
decision (`api/tracing.py`, injected as the `Tracer`: core knows no protocol and no settings). A request
made for another (a model's call, an ensemble's step) belongs to its parent's trace: traced when its parent
is, as a child of the parent's span.

The module sits in core, the lowest layer every source can import: the api (client calls, known headers)
imports it downward, core's own calls and ensembles beside it; and the rules read the model's config,
which the data plane below takes as given.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Protocol

from mpsd.config.model_config import ModelConfig
from mpsd.daemon.core.model_version import ModelVersion
from mpsd.daemon.core.response_cache import ResponseCache, request_key
from mpsd.daemon.dataplane.request import InferRequest, InferResult, InputTensor, SequenceStep
from mpsd.daemon.dataplane.tracing import NO_TRACE, RequestTrace, Trace
from mpsd.ipc.protocol import RequestParameters

Chain = frozenset[tuple[str, int]]
# Inputs of at least this many bytes are hashed for the response cache on a thread of their own.
HASH_INLINE_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class Terms:
    """What a request asks beyond its tensors, whatever its source: its priority (0: the model's default
    level), its timeout (microseconds, 0: none) and the model's own parameters."""

    priority: int = 0
    timeout_us: int = 0
    parameters: RequestParameters = ()


NO_TERMS = Terms()


def terms_of(request: InferRequest) -> Terms:
    """The terms a request was built with, for a request made on its behalf (an ensemble's step)."""
    return Terms(request.priority, request.timeout_us, request.parameters)


def reads_parameters(config: ModelConfig) -> bool:
    """Whether the model's own request parameters reach it: a python model reads them, an ensemble passes
    them on to its steps; any other model refuses them from a client (`parse.check_request_fields`)."""
    return config.backend == "python" or config.ensemble_scheduling is not None


def cacheable(
    config: ModelConfig,
    inputs: tuple[InputTensor, ...],
    sequence: SequenceStep | None,
    shm_outputs: bool,
) -> bool:
    """Whether the response cache may answer the request: the model enables it and answers once, and the
    request is no sequence's step and reads or writes no client's shared memory."""
    if not config.response_cache.enable or config.model_transaction_policy.decoupled:
        return False
    if sequence is not None or shm_outputs:
        return False
    return all(isinstance(t.data, bytes | bytearray | memoryview) for t in inputs)


def _build(
    config: ModelConfig,
    model: str,
    version: str,
    request_id: str,
    inputs: tuple[InputTensor, ...],
    outputs: tuple[str, ...],
    batch_size: int,
    terms: Terms,
    chain: Chain = frozenset(),
    sequence: SequenceStep | None = None,
    shm_outputs: bool = False,
    trace: RequestTrace | None = None,
) -> InferRequest:
    return InferRequest(
        model=model,
        version=version,
        id=request_id,
        inputs=inputs,
        outputs=outputs,
        batch_size=batch_size,
        chain=chain,
        parameters=terms.parameters if reads_parameters(config) else (),
        sequence=sequence,
        trace=trace,
        priority=terms.priority,
        timeout_us=terms.timeout_us,
        cacheable=cacheable(config, inputs, sequence, shm_outputs),
    )


def from_client(
    config: ModelConfig,
    model: str,
    version: str,
    request_id: str,
    inputs: tuple[InputTensor, ...],
    outputs: tuple[str, ...],
    batch_size: int,
    terms: Terms,
    sequence: SequenceStep | None,
    shm_outputs: bool,
    trace: RequestTrace | None = None,
) -> InferRequest:
    """A client's call, checked (`api.parse`): gRPC, HTTP, OpenAI's API and /generate."""
    return _build(
        config, model, version, request_id, inputs, outputs, batch_size, terms, sequence=sequence,
        shm_outputs=shm_outputs, trace=trace,
    )  # fmt: skip


def from_call(
    config: ModelConfig,
    model: str,
    version: int,
    request_id: str,
    inputs: tuple[InputTensor, ...],
    outputs: tuple[str, ...],
    batch_size: int,
    timeout_us: int,
    chain: Chain,
    trace: RequestTrace | None = None,
) -> InferRequest:
    """A python model's call: only its timeout, no priority or parameters (its API has neither)."""
    terms = Terms(timeout_us=timeout_us)
    return _build(
        config, model, str(version), request_id, inputs, outputs, batch_size, terms, chain, trace=trace
    )


def for_step(
    config: ModelConfig,
    model: str,
    version: int,
    ensemble: InferRequest,
    inputs: tuple[InputTensor, ...],
    outputs: tuple[str, ...],
    batch_size: int,
    chain: Chain,
    trace: RequestTrace | None = None,
) -> InferRequest:
    """An ensemble's step: the ensemble request's priority, timeout and parameters, as Triton passes them;
    each step's model places it on its own priority levels. `trace`: the step's span, when traced."""
    terms = terms_of(ensemble)
    return _build(
        config, model, str(version), ensemble.id, inputs, outputs, batch_size, terms, chain, trace=trace
    )


@dataclass(frozen=True, slots=True)
class Deadline:
    """The times (time.monotonic()) that bound a request: `client`, when whoever waits for it stops
    waiting (a client's deadline, the calling execution's, the ensemble request's); `bounded`, the earlier
    of that and the request's timeout counted from its arrival: the time by which it must have started."""

    client: float | None
    bounded: float | None

    @classmethod
    def of(cls, client: float | None, timeout_us: int, now: float | None = None) -> Deadline:
        if timeout_us <= 0:
            return cls(client, client)
        limit = (time.monotonic() if now is None else now) + timeout_us / 1e6
        return cls(client, limit if client is None else min(client, limit))

    def queue(self, request: InferRequest, config: ModelConfig) -> float | None:
        """The deadline the request queues with: `bounded`, or only `client` where the request's priority
        level lets its timeout override the level's (the queue applies it then, with the level's action,
        as Triton does), and for an ensemble, which has no queue: each step applies the timeout from its
        own arrival at its model, as Triton's steps do."""
        if request.timeout_us and (config.ensemble_scheduling is not None or _overrides(request, config)):
            return self.client
        return self.bounded


def _overrides(request: InferRequest, config: ModelConfig) -> bool:
    """Whether the request's priority level lets its timeout stand for the level's queue timeout."""
    db = config.dynamic_batching
    return db is not None and db.policy(db.level(request.priority)).allow_timeout_override


# The stages every request passes between its model version and that version's data plane, whatever its
# source: the wait for a load on demand, the response cache, and its trace.
class Tracer(Protocol):
    """Which requests made for another are traced (api's `Tracing`, under the trace settings)."""

    def continued(self, model: str, version: str, request_id: str, parent: str, name: str) -> Trace:
        """The trace of a request for `model` made by the one whose span `parent` names (a W3C
        traceparent; "": that one is not traced)."""
        ...


class NoTracer:
    """A daemon that traces nothing (until the api's tracing is installed)."""

    def continued(self, model: str, version: str, request_id: str, parent: str, name: str) -> Trace:
        return NO_TRACE


class Loads(Protocol):
    """The registry as the stages use it."""

    async def acquire(self, name: str, version: str, deadline: float | None) -> ModelVersion: ...

    def loads_first(self, name: str) -> bool: ...


class Stages:
    """The response cache (None: off) and the tracer, shared by every source of requests."""

    def __init__(self, cache: ResponseCache | None = None, tracer: Tracer | None = None) -> None:
        self.cache = cache
        self.tracer: Tracer = tracer if tracer is not None else NoTracer()

    def acquire(
        self, models: Loads, name: str, version: str, deadline: float | None, trace: Trace
    ) -> Awaitable[ModelVersion]:
        """The model version for a request; a traced request's wait for a load on demand is a span. (Not a
        coroutine of its own, as `infer`: an untraced request awaits no more frames than the registry's.)"""
        waiting = models.acquire(name, version, deadline)
        return trace.timed("load", waiting) if models.loads_first(name) else waiting

    def caches(self, request: InferRequest) -> bool:
        """Whether the response cache answers the request (then the known-header path never learns it)."""
        return request.cacheable and self.cache is not None

    def infer(
        self, mv: ModelVersion, request: InferRequest, deadline: float | None
    ) -> Awaitable[InferResult]:
        """The request's result: from the response cache where it applies, from the model otherwise."""
        if request.cacheable and self.cache is not None:
            return self._cached(self.cache, mv, request, deadline)
        return mv.plane.infer(request, deadline)

    @staticmethod
    async def _cached(
        cache: ResponseCache, mv: ModelVersion, request: InferRequest, deadline: float | None
    ) -> InferResult:
        """The request's result from the response cache, or from the model and then kept there."""
        start = time.perf_counter_ns()
        cache.seen(mv.label, mv.fingerprint)
        if sum(len(t.data) for t in request.inputs) < HASH_INLINE_BYTES:
            key = request_key(mv.fingerprint, request)
        else:  # hashing releases the GIL: large inputs are hashed beside the event loop, not on it
            key = await asyncio.to_thread(request_key, mv.fingerprint, request)
        if key is None:  # inputs in shared memory
            return await mv.plane.infer(request, deadline)
        hit = cache.get(key)
        if hit is not None:
            now = time.perf_counter_ns()
            mv.stats.record_cache_hit(now - start, now - start)
            return InferResult(mv.name, mv.version, hit)
        looked_up = time.perf_counter_ns() - start
        result = await mv.plane.infer(request, deadline)
        t0 = time.perf_counter_ns()
        cache.put(mv.label, key, result.outputs)
        mv.stats.cache_miss.add(looked_up + time.perf_counter_ns() - t0)
        return result
