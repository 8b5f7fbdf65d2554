"""Rolling a model from the versions that run to the versions its source asks for.

The version state machine: unchanged versions are kept, count-only changes resize in place where they can,
new versions are started and warmed up beside the old ones (or after them when both do not fit the memory
budget), routing switches in one assignment, and the old versions drain in the background. A failed load
leaves the old versions serving and is remembered, so an unchanged broken model is not retried in a loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import structlog

from mpsd.config.model_config import ModelConfig
from mpsd.config.repository import ModelSource
from mpsd.daemon.core.calls import ModelCalls
from mpsd.daemon.core.ensemble import EnsemblePlane, StepModels
from mpsd.daemon.core.model_version import ModelVersion, VersionState
from mpsd.daemon.core.requests import Stages
from mpsd.daemon.dataplane.request import InferRequest
from mpsd.daemon.supervise.instance import SupervisorSettings
from mpsd.daemon.supervise.launch import plan_version
from mpsd.daemon.supervise.placement import (
    BudgetPolicy,
    check_memory_budget,
    counts_resize_in_place,
    enforce_memory_budget,
)
from mpsd.errors import LoadError
from mpsd.net.tasks import TaskGroup

log = structlog.get_logger("mpsd.daemon.core.registry")

# A model's state is reported with the same four values as a version's (RepositoryIndex uses both).
ModelState = VersionState


@dataclass
class ModelEntry:
    name: str
    source: ModelSource | None = None
    versions: dict[int, ModelVersion] = field(default_factory=dict)
    loading: bool = False
    error: str | None = None
    failed_fingerprint: str | None = None
    # Residency (`core.residency`): why a known model is not running (None while it runs or must run),
    # when it last served and was loaded (time.monotonic()), its load on demand and who waits for it.
    cold_reason: str | None = None
    last_used: float = 0.0
    loaded_at: float = 0.0
    load_task: asyncio.Task[bool] | None = None
    waiting: int = 0
    # Replaced versions still draining: one may hold live sequences, whose requests it keeps serving.
    retiring: list[ModelVersion] = field(default_factory=list)

    def continuing(self, mv: ModelVersion, request: InferRequest) -> ModelVersion:
        """The replaced version that holds the request's live sequence, else `mv`."""
        for old in self.retiring:
            if old.plane.holds(request):
                return old
        return mv

    @property
    def state(self) -> ModelState:
        if any(v.ready for v in self.versions.values()):
            return ModelState.READY
        if self.loading:
            return ModelState.LOADING
        return ModelState.UNAVAILABLE


def only_counts_differ(old: ModelConfig, new: ModelConfig) -> bool:
    """True when the configs differ in nothing but instance_group counts (no reload needed)."""
    if old.model_dump(exclude={"instance_group"}) != new.model_dump(exclude={"instance_group"}):
        return False
    if len(old.instance_group) != len(new.instance_group):
        return False
    return all(
        a.model_dump(exclude={"count"}) == b.model_dump(exclude={"count"})
        for a, b in zip(old.instance_group, new.instance_group, strict=True)
    )


class Rollout:
    """Applies sources to model entries; shares the registry's table of entries for the memory budget."""

    def __init__(
        self,
        entries: dict[str, ModelEntry],
        settings: SupervisorSettings,
        drain_timeout_s: float,
        budget_policy: BudgetPolicy,
        models: StepModels | None = None,
    ) -> None:
        self._entries = entries
        self.models = models  # what ensembles run their steps on (the registry)
        self.stages = Stages()  # the response cache and tracer of every request, set by the api's operations
        self.calls = ModelCalls(models, self.stages) if models is not None else None  # python models' calls
        self.settings = settings
        self.drain_timeout_s = drain_timeout_s
        self.budget_policy = budget_policy
        self._loading: dict[str, ModelVersion] = {}  # label -> version being started, for the budget
        self._background = TaskGroup()  # old versions draining after a rollout

    async def apply(self, entry: ModelEntry, source: ModelSource) -> bool:
        """Bring one model's versions in line with its source; True when something changed.

        The caller holds the model's lock and runs this inside `isolation.contained`, which keeps the reason
        of whatever is raised (LoadError, a ConfigError of placement or the memory budget) in the entry; the
        versions that served before keep serving then.
        """
        fingerprint = source.fingerprint
        if entry.error is not None and entry.failed_fingerprint == fingerprint:
            entry.loading = False
            raise LoadError(entry.error)  # unchanged since it failed: do not restart workers in a loop
        if not source.ok:
            raise LoadError(source.error or "invalid model")
        assert source.config is not None
        keep: dict[int, ModelVersion] = {}
        fresh: list[ModelVersion] = []
        resized: list[tuple[ModelVersion, ModelConfig]] = []
        for v in source.versions:
            version_fp = (source.config_fingerprint, source.version_fingerprints[v])
            old = entry.versions.get(v)
            running = old if old is not None and old.state is VersionState.READY else None
            if running is not None and running.fingerprint == version_fp:
                keep[v] = running
                continue
            placements, launches = plan_version(source, v)
            if (
                running is not None
                and running.fingerprint[1] == version_fp[1]
                and only_counts_differ(running.config, source.config)
                and counts_resize_in_place(running.placements, placements)
            ):
                keep[v] = running
                resized.append((running, source.config))
                continue
            fresh.append(
                ModelVersion(
                    source.name,
                    v,
                    source.config,
                    version_fp,
                    placements,
                    launches,
                    self.settings,
                    labels=source.labels,
                    pbtxt=source.pbtxt,
                    plane=self._ensemble_plane(source, v),
                    calls=self.calls,
                )
            )
        retiring = [mv for v, mv in entry.versions.items() if keep.get(v) is not mv]
        side_by_side = self._check_budget(entry.name, fresh, retiring, resized, source)
        # Held from the check until the versions run (or fail), so models loading at the same time count
        # against each other's budget.
        for mv in fresh:
            self._loading[mv.label] = mv
        try:
            return await self._start(entry, source, keep, fresh, retiring, resized, side_by_side)
        finally:
            for mv in fresh:
                self._loading.pop(mv.label, None)

    async def _start(
        self,
        entry: ModelEntry,
        source: ModelSource,
        keep: dict[int, ModelVersion],
        fresh: list[ModelVersion],
        retiring: list[ModelVersion],
        resized: list[tuple[ModelVersion, ModelConfig]],
        side_by_side: bool,
    ) -> bool:
        for mv, config in resized:
            placements, launches = plan_version(source, mv.version)
            await mv.resize(config, (source.config_fingerprint, mv.fingerprint[1]), placements, launches)
        if not fresh and set(keep) == set(entry.versions):
            entry.source, entry.error, entry.loading = source, None, False
            return bool(resized)
        entry.loading = True
        if not side_by_side:
            log.warning(
                "old and new versions do not fit on the device together: stopping the old version first; "
                "the model is not ready until the new one is",
                model=entry.name,
            )
            await asyncio.gather(*(mv.unload(self.drain_timeout_s) for mv in retiring))
            entry.versions = dict(keep)
        log.info("loading model", model=source.name, versions=[mv.version for mv in fresh])
        results = await asyncio.gather(*(mv.load() for mv in fresh), return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            await asyncio.gather(*(mv.unload(0.0) for mv in fresh if mv.state is VersionState.READY))
            raise failures[0]
        retired = [mv for v, mv in entry.versions.items() if keep.get(v) is not mv]
        entry.versions = {**keep, **{mv.version: mv for mv in fresh}}
        entry.source, entry.error, entry.loading = source, None, False
        entry.failed_fingerprint = None
        for mv in retired:
            self._spawn(self._retire(entry, mv))
        unready = [mv for mv in entry.versions.values() if not mv.ready]
        if unready:  # what it lacks is in the index's reason too
            log.warning(
                "model loaded, not ready",
                model=source.name,
                versions=sorted(entry.versions),
                reason=unready[0].plane.lanes_down(),
                event_kind="load",
            )
        else:
            log.info("model ready", model=source.name, versions=sorted(entry.versions))
        return True

    def _check_budget(
        self,
        name: str,
        fresh: list[ModelVersion],
        retiring: list[ModelVersion],
        resized: list[tuple[ModelVersion, ModelConfig]],
        source: ModelSource,
    ) -> bool:
        """Apply the memory budget to the state after the change; say whether old and new fit side by side."""
        others = {
            mv.label: mv.placements
            for entry in self._entries.values()
            for mv in entry.versions.values()
            if mv not in retiring
        }
        others.update({label + " (loading)": mv.placements for label, mv in self._loading.items()})
        for mv, _config in resized:
            others[mv.label] = plan_version(source, mv.version)[0]
        after = {**others, **{mv.label + " (new)": mv.placements for mv in fresh}}
        for message in enforce_memory_budget(after, self.budget_policy):
            log.warning("memory budget exceeded", model=name, problem=message)
        during = {**after, **{mv.label: mv.placements for mv in retiring}}
        return not check_memory_budget(during) or self.budget_policy == "warn"

    def _ensemble_plane(self, source: ModelSource, version: int) -> EnsemblePlane | None:
        config = source.config
        if config is None or config.backend != "ensemble" or self.models is None:
            return None
        return EnsemblePlane(source.name, version, config, self.models, self.stages)

    async def _retire(self, entry: ModelEntry, mv: ModelVersion) -> None:
        """Drain a replaced version (its live sequences may still reach it meanwhile), then stop it."""
        entry.retiring.append(mv)
        try:
            await mv.unload(self.drain_timeout_s)
        finally:
            entry.retiring.remove(mv)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        self._background.spawn(coro)

    async def retired(self) -> None:
        """Wait for the old versions still draining in the background."""
        await self._background.join()
