"""The data plane of one model version, and its one typed entry: `infer(InferRequest) -> InferResult` and
`stream(InferRequest) -> AsyncIterator[InferResult]`.

A request is admitted (the version takes requests, the queue has room), then runs directly on an idle lane
or waits in the queue for the next batch a lane takes; either way `execute` lays the batch out in the
worker's regions, runs it on the lane's channel and answers each request. The version's lifecycle (core)
opens and closes the plane; supervision attaches and detaches the lanes' channels.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable, Hashable

import structlog

from mpsd.config.model_config import ModelConfig
from mpsd.daemon.dataplane.buckets import Buckets
from mpsd.daemon.dataplane.calls import Chain
from mpsd.daemon.dataplane.channel import Channel
from mpsd.daemon.dataplane.lane import Lane
from mpsd.daemon.dataplane.marshal import BatchTensors
from mpsd.daemon.dataplane.queue import Pending, RequestQueue, Told, fail_all
from mpsd.daemon.dataplane.request import InferRequest, InferResult, OutputTensor, Timings
from mpsd.daemon.dataplane.stats import VersionStats
from mpsd.daemon.dataplane.streaming import ResponseStream
from mpsd.daemon.dataplane.tensors import Tensors
from mpsd.daemon.dataplane.tracing import ExecutionTrace, TracedTensors
from mpsd.errors import ErrorCode, MpsdError, Unavailable, WorkerDied

log = structlog.get_logger("mpsd.daemon.model")

Batch = list[Pending]
Then = Callable[[asyncio.Future[InferResult]], None]  # what runs once a submitted request is answered
VersionLane = Lane[Batch, Channel]


class InFlight:
    """Requests in flight: each `with` counts one while it lasts, and `idle` is set while none are (what
    a drain waits for). A plain class, so counting a request allocates nothing."""

    __slots__ = ("count", "idle")

    def __init__(self) -> None:
        self.count = 0
        self.idle = asyncio.Event()
        self.idle.set()

    def __enter__(self) -> None:
        self.count += 1
        if self.count == 1:
            self.idle.clear()

    def __exit__(self, *exc: object) -> None:
        self.count -= 1
        if self.count == 0:
            self.idle.set()


class VersionPlane:
    """`closed` says why the plane takes no request (None while it takes them): the version's lifecycle
    sets it. `lanes` are the version's instances' lanes, in instance order."""

    tensors_type: type[BatchTensors] = BatchTensors  # what lays an execution's tensors out

    def __init__(self, name: str, version: int, config: ModelConfig) -> None:
        self.name = name
        self.version = version
        self.closed: str | None = "loading"
        self.stats = VersionStats()
        self.queue = RequestQueue(config, f"'{name}' version {version}")
        self.lanes: list[VersionLane] = []
        self.flight = InFlight()
        self.buckets = Buckets(config) if config.shape_buckets is not None else None
        self._direct: set[asyncio.Task[None]] = set()  # submitted requests' direct executions
        self._tell = self._settled  # bound once, not for every submitted request

    def new_lane(self) -> VersionLane:
        return Lane(self.queue, self.execute, self._all_lanes, self._lane_down)

    def _all_lanes(self) -> list[VersionLane]:
        return self.lanes

    @property
    def inflight(self) -> int:
        """Requests in `infer` or `stream` now."""
        return self.flight.count

    @property
    def holding(self) -> int:
        """What the version holds between requests, which keeps it in use (live sequences)."""
        return 0

    def holds(self, request: InferRequest) -> bool:
        """Whether the request continues something live here (a sequence) that a closing plane finishes."""
        return False

    async def drained(self) -> None:
        """Until no request is in flight (nor, with sequences, any sequence live)."""
        await self.flight.idle.wait()

    @property
    def ready(self) -> bool:
        if self.closed is not None:
            return False
        for lane in self.lanes:  # noqa: SIM110 (a loop, not any(): this runs for every request)
            if lane.serving:
                return True
        return False

    def lanes_down(self) -> str:
        """Why a lane that is down is, the latest of them ("" if none says)."""
        down = [lane for lane in self.lanes if not lane.serving and lane.down_reason]
        return down[-1].down_reason if down else ""

    def refusal(self) -> Unavailable:
        """Why a request is refused now: the version is not open, or no lane has a worker."""
        if self.closed is not None:
            why = f" ({self.closed})"
        else:
            down = self.lanes_down()
            why = f": {down}" if down else ""
        return Unavailable(f"model '{self.name}' version {self.version} is not ready{why}")

    async def infer(self, request: InferRequest, deadline: float | None = None) -> InferResult:
        """Run the request on an idle lane at once, or queue it for the next batch, and wait for its result.
        `deadline` (time.monotonic()) is the client's: a request still queued past it is dropped, not run."""
        item, direct = self._enter(request, deadline)
        future, start = item.future, item.enqueued_ns
        try:
            with self.flight:
                if direct is not None:
                    lane, channel = direct
                    # Alone in the daemon (one client's requests, one after another), a request has
                    # nobody to wait for; beside others, more are likely on their way.
                    await lane.run_direct([item], channel, gather=self.flight.count > 1)
                result = await future  # already answered after a direct execution
        except MpsdError as exc:
            self.stats.record_failure(time.perf_counter_ns() - start, exc.code.value)
            raise
        except BaseException:
            if future.done() and not future.cancelled():
                future.exception()  # the caller went away: nobody reads the error it was given
            raise
        self.stats.record_success(time.perf_counter_ns() - start, request.batch_size)
        return result

    def submit(
        self, request: InferRequest, deadline: float | None = None, then: Then | None = None
    ) -> asyncio.Future[InferResult]:
        """`infer` without a task or coroutine per request, for a caller that takes many in one callback (a
        front's link): the request is admitted at once, and its future gets the result. A direct execution
        runs in a task (`run_direct` raises nothing: it answers every future); cancelling the future drops
        the request as `infer`'s cancelled caller does. `then(future)` runs once it is counted, in the
        call that settles the future (`Told`): no callback of the loop's for each request."""
        item, direct = self._enter(request, deadline, then, submitted=True)
        self.flight.__enter__()
        if direct is not None:
            run = asyncio.get_running_loop().create_task(
                direct[0].run_direct([item], direct[1], gather=self.flight.count > 1)
            )
            self._direct.add(run)
            run.add_done_callback(self._direct.discard)
        return item.future

    def _settled(self, future: Told) -> None:
        """A submitted request's end, counted as `infer` counts its own (a cancelled one not at all)."""
        self.flight.__exit__()
        if not future.cancelled():
            error = future.exception()
            if error is None:
                self.stats.record_success(time.perf_counter_ns() - future.start, future.rows)
            elif isinstance(error, MpsdError):
                self.stats.record_failure(time.perf_counter_ns() - future.start, error.code.value)
        then, future.then = future.then, None  # let go of it, as `Told` lets go of `tell`: no cycle left
        if then is not None:
            then(future)

    def _enter(
        self, request: InferRequest, deadline: float | None, then: Then | None = None, submitted: bool = False
    ) -> tuple[Pending, tuple[VersionLane, Channel] | None]:
        """The request admitted: its place in the queue, or the idle lane it runs on at once (not queued).
        A submitted one's future is `Told`: it is counted, and `then` runs, where it is settled."""
        if not self.ready and not self.holds(request):
            raise self.refusal()
        start = self.queue.arrival_clock()
        if submitted:
            future: asyncio.Future[InferResult] = Told(self._tell, start, request.batch_size, then)
        else:
            future = asyncio.get_running_loop().create_future()
        shape_key = None if self.buckets is None else self._bucketed(request, self.buckets)
        item = Pending(request, future, start, deadline, shape_key=shape_key)
        if request.trace is not None:
            request.trace.queued()
        direct = self._free_lane(item)
        self._admit(item, queued=direct is None)
        return item, direct

    def _bucketed(self, request: InferRequest, buckets: Buckets) -> Hashable:
        """A bucketed model's batching key for the request (its lengths as buckets); a refusal is counted."""
        try:
            return buckets.admit(request)
        except MpsdError as exc:
            self.stats.record_failure(0, exc.code.value)
            raise

    def _admit(self, item: Pending, queued: bool = True) -> None:
        """Into the queue (or, for a direct execution, only its default timeout); a refusal is counted."""
        try:
            if queued:
                self.queue.put(item)
            else:
                self.queue.admit(item)
        except MpsdError as exc:
            self.stats.record_failure(0, exc.code.value)
            raise

    def _free_lane(self, item: Pending) -> tuple[VersionLane, Channel] | None:
        """A lane that would take `item` at once from the queue, and its channel: the request then runs in
        its caller's task instead of going through the queue (same order, same batching)."""
        if not self.queue.runs_at_once(item):
            return None
        for lane in self.lanes:
            channel = lane.direct_channel()
            if channel is not None:
                return lane, channel
        return None

    async def stream(
        self, request: InferRequest, deadline: float | None = None
    ) -> AsyncGenerator[InferResult, None]:
        """A decoupled model's responses to one request, each as the model yields it. Closing the iterator
        early (the client went away) stops the model at its next response."""
        if not self.ready and not self.holds(request):
            raise self.refusal()
        start = self.queue.arrival_clock()
        future: asyncio.Future[InferResult] = asyncio.get_running_loop().create_future()
        responses = ResponseStream()
        if request.trace is not None:
            request.trace.queued()
        self._admit(Pending(request, future, start, deadline, stream=responses))
        try:
            with self.flight:
                async for result in responses.responses(future):
                    yield result
        except MpsdError as exc:
            self.stats.record_failure(time.perf_counter_ns() - start, exc.code.value)
            raise
        finally:
            if not future.done():
                future.cancel()
        self.stats.record_success(time.perf_counter_ns() - start, request.batch_size, responses.delivered)

    async def execute(self, batch: Batch, channel: Channel) -> None:
        """Run a batch (one or more requests) on a worker's channel and answer every future, whatever
        happens."""
        traced = self._dequeued(batch)
        timings = Timings()
        execution = self._execution(batch, timings) if traced else None
        try:
            waiting = [item.future for item in batch]
            tensors = self._tensors(batch, waiting, execution)
            stream = batch[0].stream  # a decoupled model's request: its parts go there as they come
            sink = (
                None if stream is None else stream.sink(self.name, self.version, batch[0].timings, waiting[0])
            )
            latest, chain = _latest(batch), _chain(batch)
            outputs = await channel.infer_batch(tensors, timings, waiting, latest, sink, chain)
        except MpsdError as exc:
            self._failed(batch, channel, exc, execution)
            raise
        except BaseException as exc:
            self._aborted(batch, exc, execution)
            raise
        self._answer(batch, outputs, timings, execution)

    def _dequeued(self, batch: Batch) -> bool:
        """Each request's time in the queue, which ends here; whether any of them is traced."""
        now = time.perf_counter_ns()
        traced = False
        for item in batch:
            item.timings.queue_ns = now - item.enqueued_ns
            self.stats.queue.add(item.timings.queue_ns)
            if item.request.trace is not None:
                traced = True
        return traced

    def _tensors(
        self, batch: Batch, waiting: list[asyncio.Future[InferResult]], execution: ExecutionTrace | None
    ) -> Tensors[list[tuple[OutputTensor, ...]]]:
        """How the batch is laid out in the worker's regions and read back (`marshal.py`), traced or not."""
        requests = [item.request for item in batch]
        tensors: Tensors[list[tuple[OutputTensor, ...]]] = (
            self.tensors_type(requests, waiting)
            if self.buckets is None
            else self.buckets.tensors(requests, waiting)
        )
        return tensors if execution is None else TracedTensors(tensors, execution)

    def _failed(
        self, batch: Batch, channel: Channel, exc: MpsdError, execution: ExecutionTrace | None
    ) -> None:
        """The execution failed: every request gets its error, and the log says why (a death is logged
        once, as "worker died"; a request nobody waited for any more, not at all)."""
        if execution is not None:
            execution.failed(exc)
        fail_all(batch, exc)
        skipped = exc.code in (ErrorCode.CANCELLED, ErrorCode.DEADLINE_EXCEEDED)  # nobody waited
        if not isinstance(exc, WorkerDied) and not skipped:
            oom = exc.code is ErrorCode.RESOURCE_EXHAUSTED
            log.warning(
                "out of memory" if oom else "request failed",
                model=self.name,
                version=self.version,
                worker=channel.label,
                pid=channel.pid,
                code=exc.code.value,
                error=exc.message,
            )

    def _aborted(self, batch: Batch, exc: BaseException, execution: ExecutionTrace | None) -> None:
        """The execution was interrupted (cancelled, or a bug): every request is answered Unavailable."""
        if execution is not None:
            execution.failed(exc)
        why = f"model '{self.name}' version {self.version}: request aborted ({type(exc).__name__})"
        fail_all(batch, Unavailable(why))

    def _answer(
        self,
        batch: Batch,
        outputs: list[tuple[OutputTensor, ...]] | None,
        timings: Timings,
        execution: ExecutionTrace | None,
    ) -> None:
        """The execution's statistics, and each request's result with its timings."""
        rows = sum(item.request.batch_size for item in batch)
        if execution is not None:
            execution.done(timings.worker_span, timings.device_compute_ns, _phases(timings))
        self.stats.record_execution(
            rows,
            timings.compute_input_ns,
            timings.compute_infer_ns,
            timings.compute_output_ns,
            len(batch),
            timings.device_compute_ns,
        )
        # Time spent in the worker's socket behind the execution before it is queueing too (Triton's
        # queue time ends when the execution starts).
        self.stats.queue.add(timings.worker_wait_ns * len(batch), count=0)
        if outputs is None:  # a decoupled model's request: its responses went out as they came
            outputs = [()] * len(batch)
        for item, result in zip(batch, outputs, strict=True):
            item.timings.queue_ns += timings.worker_wait_ns
            item.timings.compute_input_ns = timings.compute_input_ns
            item.timings.compute_infer_ns = timings.compute_infer_ns
            item.timings.compute_output_ns = timings.compute_output_ns
            if not item.future.done():
                item.future.set_result(InferResult(self.name, self.version, result, item.timings))

    def _execution(self, batch: Batch, timings: Timings) -> ExecutionTrace:
        """The span of an execution with traced requests; its traceparent goes to the worker in the Infer
        frame (`timings.trace`)."""
        traces = [item.request.trace for item in batch if item.request.trace is not None]
        rows = sum(item.request.batch_size for item in batch)
        execution = ExecutionTrace.begin(traces, self.name, self.version, rows, len(batch))
        timings.trace = execution.traceparent
        return execution

    def _lane_down(self) -> None:
        """No request may wait for a lane that is not coming back soon: fail the queue if none serves."""
        if not any(lane.serving for lane in self.lanes):
            self.fail_queued(self.refusal())

    def fail_queued(self, error: MpsdError) -> None:
        fail_all(self.queue.take_all(), error)


def _phases(timings: Timings) -> dict[str, int]:
    return {
        "compute_input_ns": timings.compute_input_ns,
        "compute_infer_ns": timings.compute_infer_ns,
        "compute_output_ns": timings.compute_output_ns,
    }


def _latest(batch: Batch) -> float | None:
    """The batch's deadline: the latest of its requests' (None: one of them has none)."""
    deadlines = [item.deadline for item in batch]
    return None if None in deadlines else max(d for d in deadlines if d is not None)


def _chain(batch: Batch) -> Chain:
    """The ensemble calls the batch's requests came through: a call from this execution may not reach any
    of them."""
    chain = batch[0].request.chain
    if len(batch) > 1:
        chain = chain.union(*(item.request.chain for item in batch))
    return chain
