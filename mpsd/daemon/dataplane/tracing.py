"""A traced request's OpenTelemetry spans, from the protocol adapter to the worker and back.

A request that is traced carries a `RequestTrace` (`InferRequest.trace`; None otherwise, and then nothing
here runs): its span is the request's, and every stage is a child of it: the adapter's parse and checks,
the wait for a load on demand, the queue, the answer. An execution is one span (`ExecutionTrace`), a child
of its first traced request's span and linked to every traced request of its batch, with the copy of the
inputs, the worker's span and the copy of the outputs under it. The worker's span crosses the IPC: the Infer
frame carries the execution span's traceparent, the worker makes its span under it and sends it back with
its answer (`p.WorkerSpan`), and the daemon exports it beside its own.

OpenTelemetry is imported when the first span is made (`Spans.tracer`), never on a daemon that does not
trace.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, Awaitable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from mpsd.config.daemon_config import TraceConfig
from mpsd.daemon.dataplane.tensors import Place, Tensors
from mpsd.ipc import protocol as p

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.trace import Span, Tracer

T = TypeVar("T")
SCOPE = "mpsd"
EXPORT_TIMEOUT_S = 5.0  # one export's time limit, its retries included
FLUSH_S = 3.0  # the longest the daemon's stop waits for the spans still held


def traceparent(span: Span) -> str:
    """The W3C traceparent naming `span` as the parent."""
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def _error(span: Span, exc: BaseException) -> None:
    from opentelemetry.trace import Status, StatusCode

    if isinstance(exc, GeneratorExit):  # a stream its reader closed: no error of the request's
        return

    span.set_status(Status(StatusCode.ERROR, getattr(exc, "message", None) or type(exc).__name__))


class Spans:
    """The daemon's span exporter: a tracer provider whose batch span processor sends OTLP (HTTP or gRPC)
    to the configured endpoint, made at the first span."""

    def __init__(self, config: TraceConfig) -> None:
        self.config = config
        self._tracer: Tracer | None = None
        self._provider: TracerProvider | None = None
        self._processor: BatchSpanProcessor | None = None

    @property
    def tracer(self) -> Tracer:
        if self._tracer is None:
            self._start()
        assert self._tracer is not None
        return self._tracer

    def _start(self) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        config = self.config
        exporter: Any
        if config.protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

            exporter = GrpcExporter(endpoint=config.url, insecure=config.insecure, timeout=EXPORT_TIMEOUT_S)
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

            exporter = HttpExporter(endpoint=config.url, timeout=EXPORT_TIMEOUT_S)
        resource = Resource.create({"service.name": "mpsd", **config.resource})
        # Not shut down at the interpreter's exit: the daemon sends what is left at its stop, within a bound.
        self._provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        self._processor = BatchSpanProcessor(
            exporter,
            max_queue_size=config.bsp_max_queue_size,
            schedule_delay_millis=config.bsp_schedule_delay_ms,
            max_export_batch_size=min(config.bsp_max_export_batch_size, config.bsp_max_queue_size),
        )
        self._provider.add_span_processor(self._processor)
        self._tracer = self._provider.get_tracer(SCOPE)

    def begin(
        self, name: str, parent: str | None, start_ns: int, attributes: dict[str, str | int]
    ) -> RequestTrace:
        """A request's trace: its span continues `parent` (a W3C traceparent) or starts a trace of its own."""
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        context = TraceContextTextMapPropagator().extract({"traceparent": parent}) if parent else None
        span = self.tracer.start_span(
            name, context=context, kind=SpanKind.SERVER, start_time=start_ns, attributes=attributes
        )
        return RequestTrace(self, span)

    def export_worker(self, worker: p.WorkerSpan, attributes: dict[str, str | int]) -> None:
        """Export the worker's span as it made it: its ids, its parent (the execution's span), its times."""
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        from opentelemetry.trace import SpanContext, TraceFlags

        tracer = self.tracer  # started
        assert self._processor is not None and self._provider is not None and tracer is not None
        flags = TraceFlags(TraceFlags.SAMPLED)
        span = ReadableSpan(
            "compute",
            context=SpanContext(worker.trace_id, worker.span_id, is_remote=False, trace_flags=flags),
            parent=SpanContext(worker.trace_id, worker.parent_id, is_remote=True, trace_flags=flags),
            resource=self._provider.resource,
            attributes={"process": "worker", **attributes},
            start_time=worker.start_ns,
            end_time=worker.end_ns,
            instrumentation_scope=InstrumentationScope(SCOPE),
        )
        self._processor.on_end(span)

    def shutdown(self) -> None:
        """Send what is still held, for at most FLUSH_S: a collector that does not answer holds the stop no
        longer (the processor's thread, a daemon thread, ends with the process)."""
        if self._provider is not None:
            self._provider.force_flush(timeout_millis=int(FLUSH_S * 1000))


class RequestTrace:
    """One traced request: its span, and its stages as children of it."""

    __slots__ = ("_queue", "span", "spans")
    traced = True

    @property
    def carried(self) -> RequestTrace:
        """What the request carries into the data plane (`InferRequest.trace`)."""
        return self

    def __init__(self, spans: Spans, span: Span) -> None:
        self.spans = spans
        self.span = span
        self._queue: Span | None = None

    def child(self, name: str, start_ns: int | None = None, **attributes: str | int) -> Span:
        from opentelemetry.trace import set_span_in_context

        context = set_span_in_context(self.span)
        return self.spans.tracer.start_span(name, context=context, start_time=start_ns, attributes=attributes)

    def mark(self, name: str, start_ns: int) -> None:
        """A child span from `start_ns` until now (the adapter's reading of the request)."""
        self.child(name, start_ns).end()

    def nested(self, name: str, **attributes: str | int) -> RequestTrace:
        """A child span as the trace of a request made for this one (an ensemble's step)."""
        return RequestTrace(self.spans, self.child(name, None, **attributes))

    @contextlib.contextmanager
    def stage(self, name: str, start_ns: int | None = None, **attributes: str | int) -> Iterator[Span]:
        """A child span around the block, marked failed when the block raises."""
        span = self.child(name, start_ns, **attributes)
        try:
            yield span
        except BaseException as exc:
            _error(span, exc)
            raise
        finally:
            span.end()

    @contextlib.contextmanager
    def answering(self) -> Iterator[None]:
        """The adapter writes the answer: a span, then the request's span ends."""
        try:
            with self.stage("response"):
                yield
        except BaseException as exc:
            self.end(exc)
            raise
        self.end()

    def timed(self, name: str, waiting: Awaitable[T]) -> Awaitable[T]:
        """`waiting` as a child span (a wait for a load on demand)."""
        return self._timed(name, waiting)

    async def _timed(self, name: str, waiting: Awaitable[T]) -> T:
        with self.stage(name):
            return await waiting

    def queued(self) -> None:
        self._queue = self.child("queue")

    def dequeued(self) -> None:
        if self._queue is not None:
            self._queue.end()
            self._queue = None

    def end(self, exc: BaseException | None = None) -> None:
        """The request is answered (or failed with `exc`)."""
        self.dequeued()
        if exc is not None:
            _error(self.span, exc)
        self.span.end()

    async def responses(self, responses: AsyncGenerator[T, None]) -> AsyncGenerator[T, None]:
        """A stream's responses, each a span from its arrival until the reader asks for the next; the
        request's span ends with the stream."""
        index = 0
        try:
            async for answered in responses:
                with self.stage("response", index=index):
                    yield answered
                index += 1
        except BaseException as exc:
            self.end(exc)
            raise
        else:
            self.end()
        finally:
            await responses.aclose()


_NOTHING: AbstractContextManager[None] = contextlib.nullcontext()


class NoTrace:
    """The trace stage of a request that is not traced: the same calls as a `RequestTrace`, each doing
    nothing, so a traced and an untraced request run the same code (one shared instance, `NO_TRACE`)."""

    __slots__ = ()
    traced = False
    carried = None

    def stage(
        self, name: str, start_ns: int | None = None, **attributes: str | int
    ) -> AbstractContextManager[None]:
        return _NOTHING

    def answering(self) -> AbstractContextManager[None]:
        return _NOTHING

    def mark(self, name: str, start_ns: int) -> None:
        pass

    def nested(self, name: str, **attributes: str | int) -> NoTrace:
        return self

    def timed(self, name: str, waiting: Awaitable[T]) -> Awaitable[T]:
        return waiting

    def end(self, exc: BaseException | None = None) -> None:
        pass

    def responses(self, responses: AsyncGenerator[T, None]) -> AsyncGenerator[T, None]:
        return responses


NO_TRACE = NoTrace()
Trace = RequestTrace | NoTrace  # a request's trace stage: its spans, or nothing


def stage_of(trace: RequestTrace | None) -> Trace:
    """The trace stage of a request the data plane carries (`InferRequest.trace`, None: not traced)."""
    return NO_TRACE if trace is None else trace


class ExecutionTrace:
    """One execution of a batch with traced requests: a span under the first one's, linked to each."""

    def __init__(self, traces: Sequence[RequestTrace], attributes: dict[str, str | int]) -> None:
        from opentelemetry.trace import Link, set_span_in_context

        first = traces[0]
        self.spans = first.spans
        links = [Link(t.span.get_span_context()) for t in traces]
        context = set_span_in_context(first.span)
        self.span = self.spans.tracer.start_span(
            "execute", context=context, links=links, attributes=attributes
        )
        self.attributes = attributes

    @classmethod
    def begin(
        cls, traces: Sequence[RequestTrace], model: str, version: int, rows: int, requests: int
    ) -> ExecutionTrace:
        """The span of an execution of `rows` rows from `requests` requests, `traces` the traced ones,
        whose queue spans end here."""
        for trace in traces:
            trace.dequeued()
        attributes: dict[str, str | int] = {
            "model_name": model,
            "model_version": version,
            "batch_size": rows,
            "requests": requests,
        }
        return cls(traces, attributes)

    @property
    def traceparent(self) -> str:
        return traceparent(self.span)

    def stage(self, name: str) -> Span:
        from opentelemetry.trace import set_span_in_context

        return self.spans.tracer.start_span(name, context=set_span_in_context(self.span))

    def done(self, worker: p.WorkerSpan | None, device_ns: int | None, phases: dict[str, int]) -> None:
        extra: dict[str, str | int] = dict(phases)
        if device_ns is not None:
            extra["device_compute_ns"] = device_ns
        if worker is not None:
            self.spans.export_worker(worker, {**self.attributes, **extra})
        self.span.set_attributes(extra)
        self.span.end()

    def failed(self, exc: BaseException) -> None:
        _error(self.span, exc)
        self.span.end()


class TracedTensors(Generic[T]):
    """An execution's tensors with the copies into the worker's region and out of it as spans."""

    def __init__(self, tensors: Tensors[T], execution: ExecutionTrace) -> None:
        self._tensors = tensors
        self._execution = execution

    @property
    def refs(self) -> tuple[p.TensorRef, ...]:
        return self._tensors.refs

    @property
    def sequence(self) -> tuple[tuple[int, bool], ...]:
        return self._tensors.sequence

    def lay_out(self) -> int:
        return self._tensors.lay_out()

    def write(self, buf: memoryview, place: Place | None) -> tuple[p.Piece, ...]:
        span = self._execution.stage("input copy")
        try:
            return self._tensors.write(buf, place)
        finally:
            span.end()

    def outputs(self) -> tuple[str, ...]:
        return self._tensors.outputs()

    def parameters(self) -> p.RequestParameters:
        return self._tensors.parameters()

    def read(self, refs: Sequence[p.TensorRef], buf: memoryview) -> T:
        span = self._execution.stage("output")
        try:
            return self._tensors.read(refs, buf)
        finally:
            span.end()


def now_ns() -> int:
    """The wall clock spans are stamped with."""
    return time.time_ns()
