"""One loaded version of a model: its instances, its request queue, its state and statistics."""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field

import structlog

from mpsd.config.model_config import ModelConfig
from mpsd.errors import MpsdError, Unavailable

from .instance import Instance, SupervisorSettings
from .placement import InstancePlacement
from .request import InferRequest, InferResult, Timings
from .stats import VersionStats
from .worker_process import LoadError, WorkerLaunch, WorkerProcess

log = structlog.get_logger("mpsd.daemon.model")


class VersionState(enum.Enum):
    LOADING = "LOADING"
    READY = "READY"
    UNAVAILABLE = "UNAVAILABLE"
    UNLOADING = "UNLOADING"


@dataclass
class Pending:
    """A request waiting for, or being run by, an instance. Its future always ends: result or error."""

    request: InferRequest
    future: asyncio.Future[InferResult]
    enqueued_ns: int
    timings: Timings = field(default_factory=Timings)


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
        self.queue: asyncio.Queue[Pending] = asyncio.Queue()
        self.instances = [Instance(launch, self, settings) for launch in launches]
        self.inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def label(self) -> str:
        return f"{self.name}/{self.version}"

    @property
    def ready(self) -> bool:
        return self.state is VersionState.READY and any(i.ready for i in self.instances)

    async def load(self) -> None:
        """Start every instance; if one fails, stop the others and raise LoadError with its reason."""
        t0 = time.perf_counter()
        results = await asyncio.gather(*(i.start() for i in self.instances), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await asyncio.gather(*(i.stop() for i in self.instances))
            self.state = VersionState.UNAVAILABLE
            first = errors[0]
            self.reason = str(first) if isinstance(first, LoadError) else f"{type(first).__name__}: {first}"
            raise LoadError(self.reason)
        self.state = VersionState.READY
        log.info(
            "model version ready",
            model=self.name,
            version=self.version,
            load_s=round(time.perf_counter() - t0, 3),
        )

    async def infer(self, request: InferRequest) -> InferResult:
        """Queue the request for the next free instance and wait for its result."""
        if not self.ready:
            raise Unavailable(f"model '{self.name}' version {self.version} is not ready{self._why()}")
        start = time.perf_counter_ns()
        future: asyncio.Future[InferResult] = asyncio.get_running_loop().create_future()
        self.queue.put_nowait(Pending(request, future, start))
        self.inflight += 1
        self._idle.clear()
        try:
            result = await future
        except MpsdError as exc:
            self.stats.record_failure(time.perf_counter_ns() - start, exc.code.value)
            raise
        finally:
            self.inflight -= 1
            if self.inflight == 0:
                self._idle.set()
        self.stats.record_success(time.perf_counter_ns() - start, request.batch_size)
        return result

    def _why(self) -> str:
        if self.state is not VersionState.READY:
            return f" ({self.state.value.lower()})"
        exits = [i.last_exit for i in self.instances if i.last_exit]
        return f": worker restarting after {exits[-1]}" if exits else ""

    async def execute(self, item: Pending, worker: WorkerProcess) -> None:
        """Run one queued request on a worker and settle its future, whatever happens."""
        item.timings.queue_ns = time.perf_counter_ns() - item.enqueued_ns
        self.stats.queue.add(item.timings.queue_ns)
        req = item.request
        try:
            outputs = await worker.infer(req.inputs, req.outputs, item.timings)
        except MpsdError as exc:
            if not item.future.done():
                item.future.set_exception(exc)
            raise
        except BaseException as exc:
            if not item.future.done():
                item.future.set_exception(
                    Unavailable(
                        f"model '{self.name}' version {self.version}: request aborted ({type(exc).__name__})"
                    )
                )
            raise
        t = item.timings
        self.stats.record_execution(
            req.batch_size, t.compute_input_ns, t.compute_infer_ns, t.compute_output_ns, 1
        )
        if not item.future.done():
            item.future.set_result(InferResult(self.name, self.version, outputs, t))

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
        added = [
            Instance(launch, self, self.settings) for idx, launch in wanted.items() if idx not in current
        ]
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
        while not self.queue.empty():
            item = self.queue.get_nowait()
            if not item.future.done():
                item.future.set_exception(error)

    async def unload(self, drain_timeout_s: float) -> None:
        """Stop taking requests, let in-flight ones finish (bounded), then stop the workers."""
        self.state = VersionState.UNLOADING
        if self.inflight:
            try:
                await asyncio.wait_for(self._idle.wait(), drain_timeout_s)
            except TimeoutError:
                log.warning("drain timed out", model=self.name, version=self.version, inflight=self.inflight)
        await asyncio.gather(*(i.stop() for i in self.instances))
        self.fail_queued(Unavailable(f"model '{self.name}' version {self.version} was unloaded"))
        self.state = VersionState.UNAVAILABLE
        self.reason = "unloaded"
