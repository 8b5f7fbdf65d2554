"""Which requests are traced, and the start of their traces: the adapters read the W3C traceparent a
request carries (gRPC metadata, an HTTP header) only while tracing is on, and the trace settings decide
(`trace_settings.py`); the spans themselves are made by `dataplane/tracing.py`."""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import AsyncGenerator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TypeVar

from mpsd.config.daemon_config import TraceConfig
from mpsd.config.model_config import ModelConfig
from mpsd.daemon.api.call import InferCall
from mpsd.daemon.api.client_shm import ShmLease
from mpsd.daemon.api.parse import parse_infer_request
from mpsd.daemon.api.trace_settings import TraceSettings, Update
from mpsd.daemon.core.model_version import ModelVersion
from mpsd.daemon.core.registry import Registry
from mpsd.daemon.dataplane.request import InferRequest
from mpsd.daemon.dataplane.tracing import RequestTrace, Spans, now_ns
from mpsd.errors import InvalidArgument

T = TypeVar("T")
TRACEPARENT = "traceparent"
# W3C Trace Context: version, trace id, parent id, flags; a later version may add fields after the flags.
_FIELDS = re.compile(r"([0-9a-f]{2})-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}(-.*)?")


def valid_traceparent(header: str) -> str | None:
    """The traceparent to continue (its first four fields), or None for one the spec says to ignore: version
    ff is invalid, version 00 has exactly four fields, and a later version is read by its first four
    fields when more follow (the spec's SHOULD)."""
    found = _FIELDS.fullmatch(header.strip())
    if found is None:
        return None
    version, more = found[1], found[2]
    if version == "ff" or (version == "00" and more is not None):
        return None
    return found[0][:55]


@dataclass(frozen=True)
class Incoming:
    """What an adapter knows of a request before it is read, while tracing is on: the caller's
    traceparent (None: none, or not a valid one), when the request came in, and the span's name."""

    traceparent: str | None
    start_ns: int
    name: str
    sampled: bool = False  # the sampling decided already (on the known-header path): traced


_UNTRACED = contextlib.nullcontext()


def answering(trace: RequestTrace | None) -> AbstractContextManager[None]:
    """Around the writing of an answer: a traced request's last span, then its end."""
    return _UNTRACED if trace is None else trace.answering()


def incoming(traceparent: str | None, name: str) -> Incoming:
    return Incoming(valid_traceparent(traceparent) if traceparent is not None else None, now_ns(), name)


class Tracing:
    """The trace settings and the daemon's span exporter. `on` is False while every level is OFF: the
    adapters then look for no traceparent and nothing of a trace is made."""

    def __init__(self, config: TraceConfig) -> None:
        self.settings = TraceSettings(config)
        self.spans = Spans(config)
        self.on = self.settings.on

    def update(self, model: str, update: Update, http: bool = False) -> None:
        try:
            self.settings.update(model, update, http)
        finally:
            self.on = self.settings.on

    def begin(self, model: str, version: str, request_id: str, came: Incoming) -> RequestTrace | None:
        """The request's trace, when it is traced: a traceparent continues the caller's trace (whatever the
        rate and count), other requests are sampled."""
        if not came.sampled and not self.sample(model, came):
            return None
        attributes: dict[str, str | int] = {"model_name": model, "model_version": version or "-1"}
        if request_id:
            attributes["request_id"] = request_id
        return self.spans.begin(came.name, came.traceparent, came.start_ns, attributes)

    def sample(self, model: str, came: Incoming) -> bool:
        return self.settings.sample(model, came.traceparent is not None)

    def begin_call(self, call: InferCall, came: Incoming) -> RequestTrace | None:
        """A call's trace if it is traced, with the adapter's reading of it as its first span."""
        trace = self.begin(call.model, call.version, call.id, came)
        if trace is not None:
            trace.child("parse", came.start_ns).end()
        return trace

    def setting(self, registry: Registry, model: str, update: Update, http: bool) -> dict[str, list[str]]:
        """Triton's TraceSetting: apply `update` to `model`'s setting ("": the global one), then report it.
        A model must be known (one that loads on demand may be set before its first load)."""
        if model and model not in registry.entries:
            raise InvalidArgument(f"Request for unknown model : {model}")
        if update:
            self.update(model, update, http)
        return self.settings.get(model)

    def shutdown(self) -> None:
        self.spans.shutdown()


async def acquire_traced(
    registry: Registry, call: InferCall, deadline: float | None, trace: RequestTrace | None
) -> ModelVersion:
    """The model version for a call; when it is traced, the wait for a load on demand is a span."""
    if trace is None or not registry.loads_first(call.model):
        return await registry.acquire(call.model, call.version, deadline)
    with trace.stage("load"):
        return await registry.acquire(call.model, call.version, deadline)


def checked_traced(
    call: InferCall, config: ModelConfig, shm: ShmLease, trace: RequestTrace | None
) -> InferRequest:
    """The call checked against its model's config; a traced call's checks are a span, and its request
    carries its trace. (A client's unary call is checked by Operations itself when it is not traced.)"""
    if trace is None:
        return parse_infer_request(call, config, shm)
    with trace.stage("checks"):
        parsed = parse_infer_request(call, config, shm)
    return dataclasses.replace(parsed, trace=trace)


async def traced_stream(responses: AsyncGenerator[T, None], trace: RequestTrace) -> AsyncGenerator[T, None]:
    """A traced call's responses, each a span from its arrival until the adapter asks for the next; the
    request's span ends with the stream."""
    index = 0
    try:
        async for answered in responses:
            with trace.stage("response", index=index):
                yield answered
            index += 1
    except BaseException as exc:
        trace.end(exc)
        raise
    else:
        trace.end()
    finally:
        await responses.aclose()
