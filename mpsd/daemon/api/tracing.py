"""Which requests are traced, and the start of their traces: the adapters read the W3C traceparent a
request carries (gRPC metadata, an HTTP header) only while tracing is on, and the trace settings decide
(`trace_settings.py`), for a client's request and for a request made for another (a python model's call:
`core/requests.py` asks); the spans themselves are made by `dataplane/tracing.py`."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from mpsd.config.daemon_config import TraceConfig
from mpsd.daemon.api.call import InferCall
from mpsd.daemon.api.trace_settings import TraceSettings, Update
from mpsd.daemon.core.registry import Registry
from mpsd.daemon.dataplane.tracing import NO_TRACE, Spans, Trace, now_ns
from mpsd.errors import InvalidArgument

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


def incoming(traceparent: str | None, name: str) -> Incoming:
    return Incoming(valid_traceparent(traceparent) if traceparent is not None else None, now_ns(), name)


def came_over_http(headers: Mapping[str, str], name: str) -> Incoming:
    """What a traced HTTP request (KServe's, /generate, OpenAI's) brings to its trace: its traceparent, if
    any. Its route asks only while tracing is on (`Tracing.on`), as gRPC's asks `came_with`."""
    return incoming(headers.get(TRACEPARENT), name)


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

    def begin(self, model: str, version: str, request_id: str, came: Incoming) -> Trace:
        """The request's trace, when it is traced: a traceparent continues the caller's trace (whatever the
        rate and count), other requests are sampled."""
        if not came.sampled and not self.sample(model, came):
            return NO_TRACE
        attributes: dict[str, str | int] = {"model_name": model, "model_version": version or "-1"}
        if request_id:
            attributes["request_id"] = request_id
        return self.spans.begin(came.name, came.traceparent, came.start_ns, attributes)

    def sample(self, model: str, came: Incoming) -> bool:
        return self.settings.sample(model, came.traceparent is not None)

    def begin_call(self, call: InferCall, came: Incoming) -> Trace:
        """A call's trace stage: its spans, with the adapter's reading of it as the first, when it is
        traced; NO_TRACE otherwise."""
        trace = self.begin(call.model, call.version, call.id, came)
        trace.mark("parse", came.start_ns)
        return trace

    def continued(self, model: str, version: str, request_id: str, parent: str, name: str) -> Trace:
        """A request made for another (a python model's call): traced when its parent is (`parent`, a
        traceparent, "": not traced), as a request that carries a traceparent is, unless the model's
        trace level is OFF (`core.requests.Tracer`)."""
        if not parent or not self.on:
            return NO_TRACE
        return self.begin(model, version, request_id, Incoming(parent, now_ns(), name))

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
