"""Residency of the registry's models: admission under each device's budget, loads on demand, idle unloads.

Every load of a model that is not running goes through `load`: one admission at a time decides whether it
fits, unloads the idle models it needs gone (least recently used first; pinned ones, ones in use and ones
loaded less than `min_residency_s` ago never), and reserves the model's footprint until it runs. A request
for a model that is not loaded waits in `ensure_loaded` for one shared load. A sweeper unloads models idle
for longer than their keep-alive. Unloaded models stay known, with the reason, and load again on demand.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from typing import Any

import structlog

from mpsd.config.daemon_config import DaemonConfig
from mpsd.config.repository import ModelSource
from mpsd.daemon.core.isolation import contained
from mpsd.daemon.core.model_version import ModelVersion
from mpsd.daemon.core.residency.eviction import Holder, Shortfall, choose_victims, gib
from mpsd.daemon.core.residency.footprint import Footprint, budget_bytes, budget_key, footprint, measure
from mpsd.daemon.core.residency.policy import Policy, policy_of
from mpsd.daemon.core.rollout import ModelEntry
from mpsd.daemon.supervise.device_memory import DeviceSizes
from mpsd.daemon.supervise.launch import plan_version
from mpsd.errors import DeadlineExceeded, LoadError, ResourceExhausted, Unavailable
from mpsd.net.tasks import TaskGroup

log = structlog.get_logger("mpsd.daemon.core.residency")

SWEEP_INTERVAL_S = 0.5
NOT_LOADED_YET = "not loaded yet: loads on its first request"


@dataclass
class ResidencyStats:
    """What the metrics report: counts by model, and the time requests waited for loads."""

    loads_on_demand: Counter[str] = field(default_factory=Counter)
    unloads: Counter[tuple[str, str]] = field(default_factory=Counter)  # (model, idle | evicted)
    load_wait_s: dict[str, list[float]] = field(default_factory=dict)  # model -> [sum, count]

    def waited(self, model: str, seconds: float) -> None:
        total = self.load_wait_s.setdefault(model, [0.0, 0.0])
        total[0] += seconds
        total[1] += 1


class Residency:
    def __init__(
        self,
        config: DaemonConfig,
        entries: dict[str, ModelEntry],
        apply: Callable[[ModelSource], Awaitable[bool]],
        lock_of: Callable[[str], asyncio.Lock],
        drain_timeout_s: Callable[[], float],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.sizes = DeviceSizes()
        self.stats = ResidencyStats()
        self._entries = entries
        self._apply = apply
        self._lock_of = lock_of
        self._drain_timeout_s = drain_timeout_s
        self._clock = clock
        self._measured: dict[str, int] = {}  # version label + fingerprint -> largest instance seen, bytes
        self._admission = asyncio.Lock()
        self._reserved: dict[str, Footprint] = {}  # models being loaded now
        self._sweeper: asyncio.Task[None] | None = None
        self._background = TaskGroup()  # idle models being unloaded

    # ---- policy and accounting -----------------------------------------------------------------

    def policy(self, entry: ModelEntry) -> Policy:
        return policy_of(entry.source.config if entry.source else None, self.config.residency)

    def on_demand(self, source: ModelSource) -> bool:
        return policy_of(source.config, self.config.residency).load == "on_demand"

    @staticmethod
    def cold(entry: ModelEntry) -> bool:
        """Known but not running by design (never loaded yet, idle, evicted): it loads on demand."""
        return not entry.versions and entry.cold_reason is not None

    def _key(self, mv: ModelVersion) -> str:
        return f"{mv.label}@{mv.fingerprint}"

    def version_footprint(self, mv: ModelVersion) -> Footprint:
        return footprint(mv.config, mv.placements_in_use(), self.sizes, self._measured.get(self._key(mv)))

    def entry_footprint(self, entry: ModelEntry) -> Footprint:
        return _sum(self.version_footprint(mv) for mv in entry.versions.values())

    def source_footprint(self, source: ModelSource) -> Footprint:
        """What loading `source` will take: every version it serves."""
        assert source.config is not None
        parts = []
        for v in source.versions:
            placements, _ = plan_version(source, v)
            key = f"{source.name}/{v}@{(source.config_fingerprint, source.version_fingerprints[v])}"
            parts.append(footprint(source.config, placements, self.sizes, self._measured.get(key)))
        return _sum(parts)

    def shown_footprint(self, entry: ModelEntry) -> Footprint | None:
        """What the model holds, or would take once loaded, as status reports it; None for a model whose
        source failed (it is not placed)."""
        if entry.versions:
            return self.entry_footprint(entry)
        if entry.source is not None and entry.source.ok and entry.error is None:
            return self.source_footprint(entry.source)
        return None

    def budgets(self) -> dict[str, int | None]:
        devices = {budget_key(d) for d in {"cpu"} | set(self.config.memory_budget_bytes)}
        for entry in self._entries.values():
            devices |= set(self.entry_footprint(entry).by_device)
        for reserved in self._reserved.values():
            devices |= set(reserved.by_device)
        return {d: budget_bytes(self.config, d, self.sizes) for d in sorted(devices)}

    def resident_bytes(self) -> dict[str, int]:
        held: dict[str, int] = {}
        for fp in [self.entry_footprint(e) for e in self._entries.values()] + list(self._reserved.values()):
            for device, nbytes in fp.by_device.items():
                held[device] = held.get(device, 0) + nbytes
        return held

    def _holders(self, exclude: str) -> list[Holder]:
        now = self._clock()
        holders = []
        for name, entry in self._entries.items():
            if name == exclude or not entry.versions:
                continue
            holders.append(Holder(name, self.entry_footprint(entry), entry.last_used, self._kept(entry, now)))
        for name, reserved in self._reserved.items():
            if name != exclude:
                holders.append(Holder(name, reserved, now, "loading"))
        return holders

    def _kept(self, entry: ModelEntry, now: float) -> str | None:
        if self.policy(entry).pinned:
            return "pinned"
        if entry.waiting or any(mv.inflight or mv.plane.holding for mv in entry.versions.values()):
            return "in use"
        if entry.loading:
            return "loading"
        age = now - entry.loaded_at
        if age < self.config.residency.min_residency_s:
            return f"loaded {age:.0f} s ago, min_residency_s {self.config.residency.min_residency_s:g}"
        return None

    # ---- loading -------------------------------------------------------------------------------

    async def load(self, entry: ModelEntry, source: ModelSource, why: str) -> bool:
        """Admit and load a model that is not running; ResourceExhausted when it cannot fit, LoadError when
        it fails to load."""
        if entry.error is not None and entry.failed_fingerprint == source.fingerprint:
            raise LoadError(entry.error)  # unchanged since it failed: no room is made for it
        need = self.source_footprint(source) if source.ok else Footprint({}, "unknown")
        async with self._admission:
            chosen = choose_victims(need, self.budgets(), self._holders(exclude=entry.name))
            if isinstance(chosen, Shortfall):
                message = chosen.message(entry.name)
                log.warning("model does not fit the memory budget", model=entry.name, reason=message)
                raise ResourceExhausted(message)
            unloads = [self._detach(self._entries[h.name], f"evicted for '{entry.name}'") for h in chosen]
            self._reserved[entry.name] = need
        try:
            await asyncio.gather(*unloads)
            entry.loading = True
            changed = await self._apply(source)
        finally:
            self._reserved.pop(entry.name, None)
        entry.cold_reason = None
        entry.loaded_at = entry.last_used = self._clock()
        log.info(
            "model loaded",
            model=entry.name,
            why=why,
            footprint=gib(need.total()),
            footprint_basis=need.basis,
            event_kind="residency",
        )
        return changed

    async def _load_on_request(self, entry: ModelEntry, source: ModelSource) -> bool:
        """A load on demand, inside the model's isolation boundary."""
        with contained(entry, source.fingerprint):
            return await self.load(entry, source, "request")

    async def ensure_loaded(self, entry: ModelEntry, deadline: float | None) -> None:
        """Wait, within the request's deadline and `load_timeout_s`, for the one load of a cold model."""
        settings = self.config.residency
        if entry.waiting >= settings.load_queue_size:
            raise ResourceExhausted(
                f"model '{entry.name}' is loading and {entry.waiting} requests already wait for it "
                f"(load_queue_size {settings.load_queue_size})"
            )
        task = entry.load_task
        if task is None:
            source = entry.source
            if source is None:
                raise Unavailable(f"model '{entry.name}' is not loaded ({entry.cold_reason})")
            self.stats.loads_on_demand[entry.name] += 1
            task = asyncio.create_task(self._load_on_request(entry, source), name=f"load {entry.name}")
            entry.load_task = task
            task.add_done_callback(lambda t: _load_ended(entry, t))
        timeout = settings.load_timeout_s
        if deadline is not None:
            timeout = min(timeout, deadline - time.monotonic())
        entry.waiting += 1
        start = self._clock()
        try:
            await asyncio.wait_for(asyncio.shield(task), max(timeout, 0.0))
        except TimeoutError:
            raise DeadlineExceeded(
                f"model '{entry.name}' was not loaded within {timeout:.3g} s (the request's deadline or "
                "load_timeout_s); its load goes on"
            ) from None
        except LoadError as exc:
            raise Unavailable(f"model '{entry.name}' failed to load: {exc}") from None
        finally:
            entry.waiting -= 1
            self.stats.waited(entry.name, self._clock() - start)

    def keep_cold(self, entry: ModelEntry, source: ModelSource) -> None:
        """A model that loads on demand and is not running: known, with its source, not started. Its
        versions are placed first (`source_footprint`), so a config this host cannot honour raises here."""
        if entry.source is None or entry.source.fingerprint != source.fingerprint:
            entry.source, entry.error, entry.failed_fingerprint = source, None, None
        elif entry.error is not None and entry.failed_fingerprint == source.fingerprint:
            raise LoadError(entry.error)  # unchanged since it failed
        reason, entry.cold_reason = entry.cold_reason or NOT_LOADED_YET, None
        self.source_footprint(source)
        entry.cold_reason = reason

    # ---- unloading -----------------------------------------------------------------------------

    def _detach(self, entry: ModelEntry, reason: str) -> Coroutine[Any, Any, None]:
        """Stop routing to the model now (no await in between: nothing new reaches it), and return what
        stops its workers. Its measured size is kept for the next load."""
        versions = list(entry.versions.values())
        for mv in versions:
            self._remember(mv)
        entry.versions = {}
        entry.cold_reason = reason
        kind = "idle" if reason.startswith("unloaded after") else "evicted"
        self.stats.unloads[(entry.name, kind)] += 1
        log.info("model unloaded", model=entry.name, reason=reason, unload_kind=kind, event_kind="residency")

        async def stop() -> None:
            async with self._lock_of(entry.name):
                await asyncio.gather(*(mv.unload(self._drain_timeout_s()) for mv in versions))

        return stop()

    def _remember(self, mv: ModelVersion) -> None:
        placements = mv.placements_in_use()
        for instance in mv.instances:
            worker = instance.worker
            if worker is None:
                continue
            index = instance.launch.instance
            if index >= len(placements):
                continue
            device = placements[index].device_key
            self.sizes.learn(device, worker.memory)
            nbytes = measure(device, worker.memory)
            if nbytes:
                label = self._key(mv)
                self._measured[label] = max(self._measured.get(label, 0), nbytes)

    # ---- the idle sweeper ----------------------------------------------------------------------

    def start(self) -> None:
        self._sweeper = asyncio.create_task(self._sweep_forever(), name="residency sweeper")

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        await self._background.join()  # idle unloads already under way end as they would

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            try:
                self.sweep()
            except Exception:
                log.exception("residency sweep failed")

    def sweep(self) -> None:
        """Learn sizes from running workers; unload models idle past their keep-alive."""
        now = self._clock()
        for entry in list(self._entries.values()):
            for mv in entry.versions.values():
                self._remember(mv)
            if not entry.versions or entry.loading or entry.load_task is not None:
                continue
            if entry.waiting or any(mv.inflight or mv.plane.holding for mv in entry.versions.values()):
                entry.last_used = now  # idle time counts from the end of the last request
                continue
            keep = self.policy(entry).keep_alive_s
            if keep is not None and now - entry.last_used >= keep:
                self._background.spawn(self._detach(entry, f"unloaded after {keep:g} s idle"))


def _sum(parts: Iterable[Footprint]) -> Footprint:
    by_device: dict[str, int] = {}
    bases = []
    for fp in parts:
        bases.append(fp.basis)
        for device, nbytes in fp.by_device.items():
            by_device[device] = by_device.get(device, 0) + nbytes
    order = ("unknown", "measured", "cap", "declared")
    return Footprint(by_device, next((b for b in order if b in bases), "declared"))


def _load_ended(entry: ModelEntry, task: asyncio.Task[bool]) -> None:
    entry.load_task = None
    if not task.cancelled():
        task.exception()  # retrieved: every waiter has its own answer
