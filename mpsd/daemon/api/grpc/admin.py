"""`mpsd.v1.MpsdAdmin`: what only the supervising daemon knows (workers, their events) and `reload`.

Thin methods in the style of the inference servicer: translate protocol <-> domain, errors through the
same `rpc` mapping.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import structlog

from mpsd.daemon.api.grpc.inference import status_mapped
from mpsd.daemon.core.model_version import ModelVersion, VersionInstance
from mpsd.daemon.core.registry import ModelEntry, Registry
from mpsd.errors import InvalidArgument
from mpsd.logs.events import BUS, Event, EventBus, EventFilter
from mpsd.proto import admin_pb2 as pb
from mpsd.proto import admin_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from mpsd.daemon.supervise.fronts.pool import FrontInfo

log = structlog.get_logger("mpsd.daemon.api.grpc.admin")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["MpsdAdmin"].full_name


def event_message(event: Event, dropped: int = 0, replayed: bool = False) -> Any:
    return pb.LogEvent(
        seq=event.seq,
        time=event.time,
        level=event.level,
        kind=event.kind,
        message=event.message,
        model=event.model,
        version=event.version,
        pid=event.pid,
        worker=event.worker,
        fields=dict(event.fields),
        dropped=dropped,
        replayed=replayed,
    )


def residency_message(registry: Registry, entry: ModelEntry, now: float) -> Any:
    residency = registry.residency
    policy = residency.policy(entry)
    fp = residency.shown_footprint(entry)
    msg = pb.Residency(
        model=entry.name,
        resident=bool(entry.versions),
        pinned=policy.pinned,
        load=policy.load,
        keep_alive=policy.describe_keep_alive(),
    )
    if entry.versions and entry.last_used > 0:
        msg.idle_s = max(0.0, now - entry.last_used)
    if fp is not None:
        msg.footprint.update(fp.by_device)
        msg.footprint_basis = fp.basis
    return msg


def worker_message(mv: ModelVersion, instance: VersionInstance, now: float) -> Any:
    launch = instance.launch
    worker = instance.worker
    msg = pb.Worker(
        model=launch.model.name,
        version=launch.model.version,
        instance=launch.instance,
        instance_kind=launch.kind,
        state=instance.state,
        version_state=mv.state.value,
        restarts=instance.restarts,
        last_exit=instance.last_exit or "",
        last_error=instance.last_error or "",
    )
    if worker is None:
        return msg
    running = worker.returncode is None and not worker.died.is_set()
    msg.pid = (worker.pid or 0) if running else 0
    msg.memory.update(worker.memory)
    if instance.ready and instance.started_at > 0:
        msg.uptime_s = now - instance.started_at
    if worker.ready is not None:
        device = worker.ready.device
        msg.device.kind = str(device.get("kind") or "")
        msg.device.name = str(device.get("name") or "")
        index = device.get("index")
        if isinstance(index, int):
            msg.device.index = index
        skipped = device.get("skipped")
        if isinstance(skipped, dict):
            msg.skipped_devices.update({str(k): str(v) for k, v in skipped.items()})
        fraction = device.get("memory_fraction")
        if isinstance(fraction, int | float):
            msg.memory_fraction = float(fraction)
    return msg


class AdminServicer(pb_grpc.MpsdAdminServicer):  # type: ignore[misc]
    def __init__(self, registry: Registry, reload: Callable[[], Awaitable[str]], bus: EventBus = BUS) -> None:
        self.registry = registry
        self._reload = reload
        self._bus = bus
        self._closed = False
        self.fronts: Callable[[], list[FrontInfo]] | None = None  # FrontPool.describe, with fronts

    def close(self) -> None:
        """Shutdown: end every log stream now (an open stream would hold the drain), refuse new ones."""
        self._closed = True
        self._bus.close_subscriptions()

    @status_mapped
    async def StreamLogs(self, request: Any, context: Any) -> None:
        try:
            wanted = EventFilter(request.model, request.level.lower(), frozenset(request.kinds))
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        if not request.follow or self._closed:
            for event in self._bus.recent(wanted, request.replay):
                await context.write(event_message(event, replayed=True))
            return
        past, sub = self._bus.subscribe(wanted, request.replay)
        try:
            for event in past:
                await context.write(event_message(event, replayed=True))
            while (item := await sub.get()) is not None:
                event, dropped = item
                await context.write(event_message(event, dropped=dropped))
        finally:
            self._bus.unsubscribe(sub)

    @status_mapped
    async def ListWorkers(self, request: Any, context: Any) -> Any:
        now = time.monotonic()
        workers = [
            worker_message(mv, instance, now)
            for name in sorted(self.registry.entries)
            if not request.model or name == request.model
            for mv in self.registry.versions(name)
            for instance in mv.instances
        ]
        device = [
            pb.DeviceCompute(model=mv.name, version=mv.version, executions=d.count, ns=d.ns)
            for name in sorted(self.registry.entries)
            if not request.model or name == request.model
            for mv in self.registry.versions(name)
            if (d := mv.stats.device_compute).count
        ]
        fronts = []
        if self.fronts is not None and not request.model:
            fronts = [
                pb.Front(
                    index=f.index,
                    pid=f.pid,
                    state=f.state,
                    requests=f.requests,
                    restarts=f.restarts,
                    port=f.port,
                )
                for f in self.fronts()
            ]
        residency = [
            residency_message(self.registry, entry, now)
            for name, entry in sorted(self.registry.entries.items())
            if not request.model or name == request.model
        ]
        budgets = []
        if not request.model:
            held = self.registry.residency.resident_bytes()
            for key, budget in self.registry.residency.budgets().items():
                budgets.append(
                    pb.MemoryBudget(device=key, budget_bytes=budget, resident_bytes=held.get(key, 0))
                )
        return pb.ListWorkersResponse(
            workers=workers, fronts=fronts, residency=residency, budgets=budgets, device_compute=device
        )

    @status_mapped
    async def Profile(self, request: Any, context: Any) -> None:
        from mpsd.daemon.api.grpc.profile import profile

        async for event in profile(self.registry, request):
            await context.write(event)

    @status_mapped
    async def Reload(self, request: Any, context: Any) -> Any:
        log.info("reload requested", trigger="admin")
        summary = await self._reload()
        log.info("reload done", summary=summary)
        return pb.ReloadResponse(summary=summary)
