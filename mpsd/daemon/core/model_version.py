"""One loaded version of a model: its lifecycle (load, resize, unload), its instances and its state. Its
requests go through its data plane (`plane`), which the state opens and closes."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import time

import structlog

from mpsd.config.labels import Labels
from mpsd.config.model_config import ModelConfig
from mpsd.daemon.dataplane.calls import CallHandler
from mpsd.daemon.dataplane.plane import VersionPlane
from mpsd.daemon.dataplane.sequence_plane import plane_for
from mpsd.daemon.supervise.instance import Instance, SupervisorSettings
from mpsd.daemon.supervise.placement import InstancePlacement
from mpsd.daemon.supervise.worker.handle import WorkerProcess
from mpsd.daemon.supervise.worker.process import WorkerLaunch
from mpsd.errors import LoadError, MpsdError, Unavailable

log = structlog.get_logger("mpsd.daemon.model")

VersionInstance = Instance[WorkerProcess]


class VersionState(enum.Enum):
    LOADING = "LOADING"
    READY = "READY"
    UNAVAILABLE = "UNAVAILABLE"
    UNLOADING = "UNLOADING"


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
        labels: Labels | None = None,
        pbtxt: str | None = None,
        plane: VersionPlane | None = None,
        calls: CallHandler | None = None,
    ) -> None:
        self.name = name
        self.calls = calls  # what runs its workers' calls to other models (a python model's)
        self.labels: Labels = labels or {}  # classification labels per output
        self.pbtxt = pbtxt  # the config.pbtxt as written, when it is one
        self.version = version
        self.config = config
        self.fingerprint = fingerprint
        self.placements = placements
        self.settings = settings
        # An ensemble's plane runs its steps' models instead of lanes of its own.
        self.plane = plane if plane is not None else plane_for(name, version, config)
        self.stats = self.plane.stats
        self.state = VersionState.LOADING
        self.reason = ""
        self.instances: list[VersionInstance] = []
        self._set_instances([self._instance(launch) for launch in launches])
        self.load_duration_s: float | None = None

    @property
    def state(self) -> VersionState:
        return self._state

    @state.setter
    def state(self, state: VersionState) -> None:
        """Only a READY version's plane takes requests; otherwise it says which state the version is in."""
        self._state = state
        self.plane.closed = None if state is VersionState.READY else state.value.lower()

    @property
    def inflight(self) -> int:
        """Requests in the version's data plane now."""
        return self.plane.inflight

    def _instance(self, launch: WorkerLaunch) -> VersionInstance:
        return Instance(launch, self.settings, self._new_worker, self.plane.new_lane())

    def _set_instances(self, instances: list[VersionInstance]) -> None:
        self.instances = instances
        self.plane.lanes = [i.lane for i in instances]

    def _new_worker(self, launch: WorkerLaunch) -> WorkerProcess:
        settings = self.settings
        return WorkerProcess(launch, settings.request_timeout_s, settings.heartbeat_timeout_s, self.calls)

    @property
    def label(self) -> str:
        return f"{self.name}/{self.version}"

    def placements_in_use(self) -> list[InstancePlacement]:
        """The placements, with an instance whose worker reported running on the CPU (KIND_AUTO without a
        usable GPU falls back) placed there: the device it really draws memory from."""
        placements = list(self.placements)
        for instance in self.instances:
            index, worker = instance.launch.instance, instance.worker
            ready = worker.ready if worker is not None else None
            if ready is None or index >= len(placements) or ready.device.get("kind") != "cpu":
                continue
            if placements[index].device_type != "cpu":
                placements[index] = dataclasses.replace(placements[index], kind="KIND_CPU", gpu=None)
        return placements

    @property
    def ready(self) -> bool:
        return self.plane.ready

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
        if not self.plane.ready:  # loaded, yet it cannot serve (an ensemble whose step model is missing)
            log.warning(
                "model version loaded, not ready",
                model=self.name,
                version=self.version,
                reason=self.plane.lanes_down(),
                event_kind="load",
            )
            return
        log.info(
            "model version ready",
            **extra,
            model=self.name,
            version=self.version,
            load_s=round(self.load_duration_s, 3),
        )

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
        self._set_instances(
            sorted(
                [i for idx, i in current.items() if idx in wanted] + added, key=lambda i: i.launch.instance
            )
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

    def fail_queued(self, error: MpsdError) -> None:
        self.plane.fail_queued(error)

    async def unload(self, drain_timeout_s: float) -> None:
        """Stop taking requests, let in-flight ones (and live sequences) finish (bounded), then stop the
        workers."""
        self.state = VersionState.UNLOADING
        if self.inflight or self.plane.holding:
            try:
                await asyncio.wait_for(self.plane.drained(), drain_timeout_s)
            except TimeoutError:
                log.warning("drain timed out", model=self.name, version=self.version, inflight=self.inflight)
        await asyncio.gather(*(i.stop() for i in self.instances))
        self.fail_queued(Unavailable(f"model '{self.name}' version {self.version} was unloaded"))
        self.state = VersionState.UNAVAILABLE
        self.reason = "unloaded"
