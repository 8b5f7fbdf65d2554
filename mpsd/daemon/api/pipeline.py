"""The inference operations, whatever the protocol that asked for them: a call checked against its model,
run through the model version's data plane (or the response cache), and its outputs written to the client's
shared memory; a decoupled model's responses as a stream.

This is the request path's stop in the adapters' layer; the management operations (health, metadata,
repository, shared-memory registration, settings) are `operations.py`'s, whose `Operations` inherits
these, so both protocols' adapters reach them through one object.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

from mpsd.config.model_config import ModelConfig
from mpsd.daemon.api.call import InferCall
from mpsd.daemon.api.classification import classify, requested
from mpsd.daemon.api.client_shm import ClientShmRegistry
from mpsd.daemon.api.parse import call_deadline, check_name, parse_infer_request
from mpsd.daemon.api.response_cache import ResponseCache, request_key
from mpsd.daemon.api.tracing import Incoming, Tracing, acquire_traced, checked_traced, traced_stream
from mpsd.daemon.core.model_version import ModelVersion
from mpsd.daemon.core.registry import Registry
from mpsd.daemon.core.requests import Deadline
from mpsd.daemon.dataplane.request import InferRequest, InferResult
from mpsd.daemon.dataplane.tracing import RequestTrace
from mpsd.errors import MpsdError, Unimplemented

# Inputs of at least this many bytes are hashed for the response cache on a thread of their own.
HASH_INLINE_BYTES = 64 * 1024
Responses = AsyncGenerator["Answered", None]  # a decoupled model's to one call


@dataclass(frozen=True)
class Answered:
    """An inference's result, and the outputs that went to the client's shared memory instead."""

    result: InferResult
    in_shm: frozenset[str]
    trace: RequestTrace | None = None  # a traced request's: the adapter ends it with its answer


class Pipeline:
    """Inference: what `Operations` (`operations.py`) does with a request to run a model."""

    # The operations', set by `Operations.__init__`.
    registry: Registry
    tracing: Tracing
    response_cache: ResponseCache | None
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
        trace = self.tracing.begin_call(call, came) if came is not None else None
        try:
            limits = call_deadline(call, deadline)
            deadline = limits.bounded
            if trace is None:
                mv = await self.registry.acquire(call.model, call.version, deadline)
            else:
                mv = await acquire_traced(self.registry, call, deadline, trace)
            if mv.config.model_transaction_policy.decoupled:
                raise Unimplemented(
                    f"model '{mv.name}' is decoupled (it answers with a stream of responses): call it with "
                    "ModelStreamInfer, or over HTTP with /generate_stream or /generate"
                )
            try:
                with self.client_shm.lease() as shm:  # regions the request names stay open until answered
                    if trace is None:
                        parsed = parse_infer_request(call, mv.config, shm)
                    else:
                        parsed = checked_traced(call, mv.config, shm, trace)
                    deadline = limits.queue(parsed, mv.config)
                    if parsed.sequence is not None and not parsed.sequence.start:
                        mv = self._continuing(mv, parsed)
                    if parsed.cacheable and self.response_cache is not None:
                        result = await self._cached(mv, parsed, deadline)
                    else:
                        if learn is not None:  # never for a cached model: the known-header path skips it
                            learn(parsed, mv.config)
                        result = await mv.plane.infer(parsed, deadline)
                    wanted = requested(call)
                    if wanted:
                        result = classify(result, wanted, mv.config.max_batch_size > 0, mv.labels)
                    shm.write_outputs(result.outputs)
                    return Answered(result, frozenset(shm.outputs), trace)
            finally:
                self.registry.touch(call.model)
        except BaseException as exc:
            if trace is not None:
                trace.end(exc)
            raise

    def _continuing(self, mv: ModelVersion, request: InferRequest) -> ModelVersion:
        """Where a request of a live sequence goes: a replaced version still draining holds it, or `mv`."""
        entry = self.registry.entries.get(mv.name)
        return entry.continuing(mv, request) if entry is not None and entry.retiring else mv

    async def _cached(self, mv: ModelVersion, request: InferRequest, deadline: float | None) -> InferResult:
        """The request's result from the response cache, or from the model and then kept there."""
        cache = self.response_cache
        assert cache is not None
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
            parsed = bind(mv.config)
            if parsed is None:
                return None
            queued = deadline  # a request without a timeout of its own queues with the client's deadline
            if parsed.timeout_us:
                queued = Deadline.of(deadline, parsed.timeout_us).queue(parsed, mv.config)
            return Answered(await mv.plane.infer(parsed, queued), frozenset())
        finally:
            self.registry.touch(model)

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
        trace = self.tracing.begin_call(call, came) if came is not None else None
        responses = self._stream(call, deadline, trace)
        return responses if trace is None else traced_stream(responses, trace)

    async def _stream(self, call: InferCall, deadline: float | None, trace: RequestTrace | None) -> Responses:
        check_name("model", call.model)
        limits = call_deadline(call, deadline)
        mv = await acquire_traced(self.registry, call, limits.bounded, trace)
        try:
            with self.client_shm.lease() as shm:
                parsed = checked_traced(call, mv.config, shm, trace)
                if parsed.sequence is not None and not parsed.sequence.start:
                    mv = self._continuing(mv, parsed)
                wanted = requested(call)
                responses = mv.plane.stream(parsed, limits.queue(parsed, mv.config))
                try:
                    async for result in responses:
                        if wanted:
                            result = classify(result, wanted, mv.config.max_batch_size > 0, mv.labels)
                        shm.write_outputs(result.outputs)
                        yield Answered(result, frozenset(shm.outputs))
                        self.registry.touch(call.model)
                finally:
                    await responses.aclose()
        finally:
            self.registry.touch(call.model)
