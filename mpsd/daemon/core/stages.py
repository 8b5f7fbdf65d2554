"""The stages every request passes between its model version and that version's data plane, whatever its
source (a client's call, a python model's call to another model, an ensemble's step): the wait for a load
on demand, the response cache, and its trace.

A request's trace is a value that is always there (`dataplane.tracing.Trace`): a `RequestTrace` whose
stages are spans, or `NO_TRACE`, whose stages do nothing, so traced and untraced requests run one path.
Which requests are traced is the trace settings' decision (`api/tracing.py`, injected as the `Tracer`:
core knows no protocol and no settings). A request made for another (a model's call, an ensemble's step)
belongs to its parent's trace: traced when its parent is, as a child of the parent's span.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Protocol

from mpsd.daemon.core.model_version import ModelVersion
from mpsd.daemon.core.response_cache import ResponseCache, request_key
from mpsd.daemon.dataplane.request import InferRequest, InferResult
from mpsd.daemon.dataplane.tracing import NO_TRACE, Trace

# Inputs of at least this many bytes are hashed for the response cache on a thread of their own.
HASH_INLINE_BYTES = 64 * 1024


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
