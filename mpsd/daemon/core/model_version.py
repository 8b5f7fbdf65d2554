"""One loaded version of a model: its instances, its request queue, its state and statistics."""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import AsyncGenerator, Awaitable, Callable

import structlog

from mpsd.config.model_config import ModelConfig
from mpsd.daemon.dataplane.marshal import BatchTensors
from mpsd.daemon.dataplane.queue import Pending, RequestQueue, fail_all
from mpsd.daemon.dataplane.request import InferRequest, InferResult, OutputTensor, Timings
from mpsd.daemon.dataplane.stats import VersionStats
from mpsd.daemon.dataplane.streaming import ResponseStream
from mpsd.daemon.supervise.instance import Instance, SupervisorSettings
from mpsd.daemon.supervise.placement import InstancePlacement
from mpsd.daemon.supervise.worker.handle import WorkerProcess
from mpsd.daemon.supervise.worker.process import WorkerLaunch
from mpsd.errors import ErrorCode, LoadError, MpsdError, Unavailable, WorkerDied

log = structlog.get_logger("mpsd.daemon.model")

VersionInstance = Instance[list[Pending], WorkerProcess]


class VersionState(enum.Enum):
    LOADING = "LOADING"
    READY = "READY"
    UNAVAILABLE = "UNAVAILABLE"
    UNLOADING = "UNLOADING"


class InFlight:
    """Requests in flight: each `with` counts one while it lasts, and `idle` is set while none are (what
    `unload` waits for). A plain class, so counting a request allocates nothing."""

    __slots__ = ("count", "idle")

    def __init__(self) -> None:
        self.count = 0
        self.idle = asyncio.Event()
        self.idle.set()

    def __enter__(self) -> None:
        self.count += 1
        self.idle.clear()

    def __exit__(self, *exc: object) -> None:
        self.count -= 1
        if self.count == 0:
            self.idle.set()


class ModelVersion:
    def __init__(
        self,
        name: str,
        version: int,
        config: ModelConfig,
        fingerprint: tuple[str, str],
        placements: list[InstancePlacement],
        launches: list[WorkerLaunch],
        settings: SupervisorSettings,
    ) -> None:
        self.name = name
        self.version = version
        self.config = config
        self.fingerprint = fingerprint
        self.placements = placements
        self.settings = settings
        self.state = VersionState.LOADING
        self.reason = ""
        self.stats = VersionStats()
        self.queue = RequestQueue(config, f"'{name}' version {version}")
        self.instances = [self._instance(launch) for launch in launches]
        self._flight = InFlight()
        self.load_duration_s: float | None = None

    @property
    def inflight(self) -> int:
        """Requests in `infer` or `stream` now."""
        return self._flight.count

    def _instance(self, launch: WorkerLaunch) -> VersionInstance:
        return Instance(
            launch,
            self.settings,
            self._new_worker,
            self.queue,
            self.execute,
            self.instance_down,
            self._instance_count,
        )

    def _new_worker(self, launch: WorkerLaunch) -> WorkerProcess:
        return WorkerProcess(launch, self.settings.request_timeout_s, self.settings.heartbeat_timeout_s)

    def _instance_count(self) -> int:
        return len(self.instances)

    @property
    def label(self) -> str:
        return f"{self.name}/{self.version}"

    @property
    def ready(self) -> bool:
        if self.state is not VersionState.READY:
            return False
        for instance in self.instances:  # noqa: SIM110 (a loop, not any(): this runs for every request)
            if instance.ready:
                return True
        return False

    async def load(self) -> None:
        """Start every instance; if one fails, stop the others and raise LoadError with its reason."""
        t0 = time.perf_counter()
        try:
            results = await asyncio.gather(*(i.start() for i in self.instances), return_exceptions=True)
        except asyncio.CancelledError:  # the daemon stops mid-load: no instance that started outlives it
            await asyncio.gather(*(i.stop() for i in self.instances), return_exceptions=True)
            self.state = VersionState.UNAVAILABLE
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await asyncio.gather(*(i.stop() for i in self.instances))
            self.state = VersionState.UNAVAILABLE
            first = errors[0]
            self.reason = str(first) if isinstance(first, LoadError) else f"{type(first).__name__}: {first}"
            raise LoadError(self.reason)
        self.state = VersionState.READY
        self.load_duration_s = time.perf_counter() - t0
        compiled = [
            ready.compile_ms
            for i in self.instances
            if i.worker is not None and (ready := i.worker.ready) is not None and ready.compile_ms is not None
        ]
        # optimization.compile: the slowest instance's compile time (instances compile side by side)
        extra = {"compile_ms": round(max(compiled), 1)} if compiled else {}
        log.info(
            "model version ready",
            **extra,
            model=self.name,
            version=self.version,
            load_s=round(self.load_duration_s, 3),
        )

    async def infer(self, request: InferRequest, deadline: float | None = None) -> InferResult:
        """Queue the request for the next free instance and wait for its result.

        `deadline` (time.monotonic()) is the client's: a request still queued past it is dropped, not run.
        """
        if not self.ready:
            raise Unavailable(f"model '{self.name}' version {self.version} is not ready{self._why()}")
        start = time.perf_counter_ns()
        future: asyncio.Future[InferResult] = asyncio.get_running_loop().create_future()
        item = Pending(request, future, start, deadline)
        direct = self._free_instance(item)
        self._admit(item, queued=direct is None)
        try:
            with self._flight:
                if direct is not None:
                    instance, worker = direct
                    # Alone in the daemon (one client's requests, one after another), a request has
                    # nobody to wait for; beside others, more are likely on their way.
                    await instance.run_direct([item], worker, gather=self.inflight > 1)
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

    def _free_instance(self, item: Pending) -> tuple[VersionInstance, WorkerProcess] | None:
        """An instance that would take `item` at once from the queue, and its worker: the request then
        runs in its caller's task instead of going through the queue (same order, same batching)."""
        if not self.queue.runs_at_once(item):
            return None
        for instance in self.instances:
            worker = instance.direct_worker()
            if worker is not None:
                return instance, worker
        return None

    async def stream(
        self, request: InferRequest, deadline: float | None = None
    ) -> AsyncGenerator[InferResult, None]:
        """A decoupled model's responses to one request, each as the model yields it. Closing the iterator
        early (the client went away) stops the model at its next response."""
        if not self.ready:
            raise Unavailable(f"model '{self.name}' version {self.version} is not ready{self._why()}")
        start = time.perf_counter_ns()
        future: asyncio.Future[InferResult] = asyncio.get_running_loop().create_future()
        responses = ResponseStream()
        self._admit(Pending(request, future, start, deadline, stream=responses))
        try:
            with self._flight:
                async for result in responses.responses(future):
                    yield result
        except MpsdError as exc:
            self.stats.record_failure(time.perf_counter_ns() - start, exc.code.value)
            raise
        finally:
            if not future.done():
                future.cancel()
        self.stats.record_success(time.perf_counter_ns() - start, request.batch_size, responses.delivered)

    def _why(self) -> str:
        if self.state is not VersionState.READY:
            return f" ({self.state.value.lower()})"
        down = [i for i in self.instances if not i.ready and i.last_exit]
        if not down:
            return ""
        why = f": worker restarting after {down[-1].last_exit}"
        if down[-1].last_error:
            why += f"; last restart failed: {down[-1].last_error}"
        return why

    async def execute(self, batch: list[Pending], worker: WorkerProcess) -> None:
        """Run a batch (one or more queued requests) on a worker and answer every future, whatever happens."""
        now = time.perf_counter_ns()
        for item in batch:
            item.timings.queue_ns = now - item.enqueued_ns
            self.stats.queue.add(item.timings.queue_ns)
        timings = Timings()
        try:
            deadlines = [item.deadline for item in batch]
            latest = None if None in deadlines else max(d for d in deadlines if d is not None)
            waiting = [item.future for item in batch]
            tensors = BatchTensors([item.request for item in batch], waiting)
            outputs = await worker.infer_batch(tensors, timings, waiting, latest, self._sink(batch))
        except MpsdError as exc:
            fail_all(batch, exc)
            skipped = exc.code in (ErrorCode.CANCELLED, ErrorCode.DEADLINE_EXCEEDED)  # nobody waited
            if not isinstance(exc, WorkerDied) and not skipped:  # a death is logged once, as "worker died"
                oom = exc.code is ErrorCode.RESOURCE_EXHAUSTED
                log.warning(
                    "out of memory" if oom else "request failed",
                    model=self.name,
                    version=self.version,
                    worker=worker.launch.label,
                    pid=worker.pid,
                    code=exc.code.value,
                    error=exc.message,
                )
            raise
        except BaseException as exc:
            fail_all(
                batch,
                Unavailable(
                    f"model '{self.name}' version {self.version}: request aborted ({type(exc).__name__})"
                ),
            )
            raise
        rows = sum(item.request.batch_size for item in batch)
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

    def _sink(
        self, batch: list[Pending]
    ) -> Callable[[list[tuple[OutputTensor, ...]]], Awaitable[bool]] | None:
        """Where a decoupled model's parts go: its one request's response stream (None otherwise)."""
        item = batch[0]
        responses = item.stream
        if responses is None:
            return None

        async def deliver(parts: list[tuple[OutputTensor, ...]]) -> bool:
            result = InferResult(self.name, self.version, parts[0], item.timings)
            return await responses.deliver(result, item.future)

        return deliver

    async def resize(
        self,
        config: ModelConfig,
        fingerprint: tuple[str, str],
        placements: list[InstancePlacement],
        launches: list[WorkerLaunch],
    ) -> None:
        """Add or remove instances after a count-only change, leaving the running ones untouched."""
        current = {i.launch.instance: i for i in self.instances}
        wanted = {launch.instance: launch for launch in launches}
        added = [self._instance(launch) for idx, launch in wanted.items() if idx not in current]
        results = await asyncio.gather(*(i.start() for i in added), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await asyncio.gather(*(i.stop() for i in added))
            raise LoadError(f"adding instances failed: {errors[0]}")
        removed = [i for idx, i in current.items() if idx not in wanted]
        self.instances = sorted(
            [i for idx, i in current.items() if idx in wanted] + added, key=lambda i: i.launch.instance
        )
        self.config, self.fingerprint, self.placements = config, fingerprint, placements
        log.info(
            "instance count changed",
            model=self.name,
            version=self.version,
            added=[i.launch.instance for i in added],
            removed=[i.launch.instance for i in removed],
        )
        await asyncio.gather(*(i.stop(self.settings.drain_timeout_s) for i in removed))

    def instance_down(self) -> None:
        """No request may wait for an instance that is not coming back soon: fail the queue if none is up."""
        if not any(i.ready for i in self.instances):
            self.fail_queued(
                Unavailable(f"model '{self.name}' version {self.version} is not ready{self._why()}")
            )

    def fail_queued(self, error: MpsdError) -> None:
        fail_all(self.queue.take_all(), error)

    async def unload(self, drain_timeout_s: float) -> None:
        """Stop taking requests, let in-flight ones finish (bounded), then stop the workers."""
        self.state = VersionState.UNLOADING
        if self.inflight:
            try:
                await asyncio.wait_for(self._flight.idle.wait(), drain_timeout_s)
            except TimeoutError:
                log.warning("drain timed out", model=self.name, version=self.version, inflight=self.inflight)
        await asyncio.gather(*(i.stop() for i in self.instances))
        self.fail_queued(Unavailable(f"model '{self.name}' version {self.version} was unloaded"))
        self.state = VersionState.UNAVAILABLE
        self.reason = "unloaded"
