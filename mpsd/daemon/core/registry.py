"""What is loaded and where requests go: model entries, their serving versions, load/unload with swap.

How a model goes from the versions that run to the ones its source asks for is `rollout.py`; the
registry decides which models to bring in line (a repository scan, an explicit load or unload) and keeps
one model's changes in order.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Collection
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from mpsd.config.daemon_config import DaemonConfig
from mpsd.config.repository import ModelSource, model_name_problem, scan_repository
from mpsd.daemon.core.isolation import contained
from mpsd.daemon.core.model_version import ModelVersion, VersionState
from mpsd.daemon.core.overrides import LoadParameters, Overrides
from mpsd.daemon.core.residency.manager import Residency
from mpsd.daemon.core.rollout import ModelEntry, ModelState, Rollout
from mpsd.daemon.core.versions import requested_version
from mpsd.daemon.supervise.instance import SupervisorSettings
from mpsd.daemon.supervise.placement import BudgetPolicy
from mpsd.errors import (
    InvalidArgument,
    LoadError,
    LoadRefused,
    NotFound,
    ResourceExhausted,
    Unavailable,
    UnknownModel,
)

log = structlog.get_logger("mpsd.daemon.core.registry")

__all__ = ["IndexRow", "ModelEntry", "ModelState", "ReconcileReport", "Registry"]


@dataclass
class ReconcileReport:
    changed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    unloaded: list[str] = field(default_factory=list)
    deferred: list[str] = field(default_factory=list)

    def summary(self) -> str:
        parts = [
            f"{len(self.changed)} changed",
            f"{len(self.failed)} failed",
            f"{len(self.unloaded)} unloaded",
            f"{len(self.deferred)} deferred",
        ]
        return ", ".join(parts)


def _still_changing(model_dir: Path, quiet_period_s: float) -> bool:
    """A file changed within the quiet period: the directory may still be being copied."""
    if quiet_period_s <= 0:
        return False
    horizon = time.time() - quiet_period_s
    try:
        return any(p.stat().st_mtime > horizon for p in model_dir.rglob("*"))
    except OSError:
        return True


@dataclass(frozen=True)
class IndexRow:
    name: str
    version: str
    state: str
    reason: str


class Registry:
    def __init__(
        self,
        repository: Path,
        settings: SupervisorSettings,
        drain_timeout_s: float,
        budget_policy: BudgetPolicy = "refuse",
        quiet_period_s: float = 0.0,
        config: DaemonConfig | None = None,
    ) -> None:
        self.repository = repository
        self.quiet_period_s = quiet_period_s
        self.allow_symlinks = False  # follow symlinks that leave the repository
        self.op_library_dirs: tuple[Path, ...] = ()  # op libraries may also come from these directories
        self._warned: dict[str, str] = {}  # model -> config fingerprint whose ignored fields were logged
        self.unloaded: set[str] = set()
        self.reconcile_lock = asyncio.Lock()
        self.entries: dict[str, ModelEntry] = {}
        self.rollout = Rollout(self.entries, settings, drain_timeout_s, budget_policy, models=self)
        # Until the first full scan, `entries` is empty because nothing was read yet, not because the
        # repository is empty: the server is not ready then (front processes and gRPC listen earlier).
        self.scanned = False
        self._locks: dict[str, asyncio.Lock] = {}
        config = config or DaemonConfig()
        self.residency = Residency(config, self.entries, self.apply, self._lock, lambda: self.drain_timeout_s)
        self.overrides = Overrides(config, repository, self.entries)  # loads with the request's config, files

    @property
    def drain_timeout_s(self) -> float:
        return self.rollout.drain_timeout_s

    @drain_timeout_s.setter
    def drain_timeout_s(self, value: float) -> None:
        self.rollout.drain_timeout_s = value

    @property
    def budget_policy(self) -> BudgetPolicy:
        return self.rollout.budget_policy

    @budget_policy.setter
    def budget_policy(self, value: BudgetPolicy) -> None:
        self.rollout.budget_policy = value

    # ---- routing -------------------------------------------------------------------------------

    def route(self, name: str, version: str) -> ModelVersion:
        """The version that answers a request for (name, version); "" means the latest serving one."""
        number = requested_version(version) if version else None  # read first, as Triton does; "": latest
        entry = self.entries.get(name)
        if entry is None:
            raise UnknownModel(name, number, unloaded=name in self.unloaded)
        if not entry.versions:
            if entry.error:
                reason = f": {entry.error}"
            elif entry.cold_reason:
                reason = f" ({entry.cold_reason})"
            else:
                reason = f" ({entry.state.value.lower()})"
            raise Unavailable(f"model '{name}' is not available{reason}")
        if number is None:
            return entry.versions[max(entry.versions)]
        found = entry.versions.get(number)
        if found is None:
            raise UnknownModel(name, number)
        return found

    async def acquire(self, name: str, version: str, deadline: float | None) -> ModelVersion:
        """`route`, after loading the model first when it loads on demand and is not running."""
        if self.loads_first(name):
            requested_version(version)  # a bad version loads nothing
            await self.residency.ensure_loaded(self.entries[name], deadline)
        return self.acquire_running(name, version)

    def acquire_running(self, name: str, version: str) -> ModelVersion:
        """`acquire` for a model that is not waiting to load (the caller has checked `loads_first`): no
        coroutine to create and await on every request."""
        mv = self.route(name, version)
        self.touch(name)
        return mv

    def loads_first(self, name: str) -> bool:
        """Whether a request for the model must wait for it to load (`acquire`)."""
        entry = self.entries.get(name)
        return entry is not None and not entry.versions and self.residency.cold(entry)  # running: never cold

    def touch(self, name: str) -> None:
        """The model served a request now: it is the most recently used."""
        entry = self.entries.get(name)
        if entry is not None:
            entry.last_used = time.monotonic()

    def known(self, name: str, version: str) -> None:
        """UnknownModel unless the model (and version) is known, running or loading on demand."""
        if version:  # "" names the latest: nothing to read
            requested_version(version)
        entry = self.entries.get(name)
        if entry is None or entry.versions or not self.residency.cold(entry):  # running: never cold
            self.route(name, version)

    def model_available(self, name: str) -> bool:
        """Ready, or loads on its next request (what per-model health reports to load balancers)."""
        entry = self.entries.get(name)
        if entry is not None and not entry.versions and self.residency.cold(entry) and entry.error is None:
            return True
        return self.model_ready(name)

    def model_ready(self, name: str, version: str = "") -> bool:
        try:
            return self.route(name, version).ready
        except (NotFound, Unavailable):
            return False

    def server_ready(self) -> bool:
        """The repository has been read and every model it holds is ready (Triton's strict readiness)."""
        return self.scanned and all(
            e.state is ModelState.READY or (self.residency.cold(e) and e.error is None)
            for e in self.entries.values()
        )

    # ---- loading -------------------------------------------------------------------------------

    async def reconcile(
        self, only: Collection[str] | None = None, wait_quiet: bool = True
    ) -> ReconcileReport:
        """Compare what the repository says now with what runs, and act. Idempotent.

        `only` limits the step to some models (RepositoryModelLoad); models unloaded by an operator stay
        unloaded until loaded again explicitly.
        """
        async with self.reconcile_lock:
            return await self._reconcile(only, wait_quiet)

    async def _reconcile(self, only: Collection[str] | None, wait_quiet: bool) -> ReconcileReport:
        desired = self.overrides.apply(
            scan_repository(self.repository, self.allow_symlinks, self.op_library_dirs)
        )
        report = ReconcileReport()
        names = sorted(set(only) if only is not None else set(desired) | set(self.entries))
        jobs: list[Awaitable[None]] = []
        ensembles: list[Awaitable[None]] = []  # after their steps: ready when they load
        for name in names:
            source = desired.get(name)
            if only is None and name in self.unloaded:
                continue
            if source is None:
                if name in self.entries:
                    report.unloaded.append(name)
                    jobs.append(self.unload_model(name))
                continue
            overridden = name in self.overrides.by_model  # files written by the daemon, all at once
            if wait_quiet and not overridden and _still_changing(source.path, self.quiet_period_s):
                report.deferred.append(name)
                log.info(
                    "model files still changing: load deferred",
                    model=name,
                    quiet_period_s=self.quiet_period_s,
                    event_kind="reload",
                )
                continue
            entry = self.entries.get(name)
            if entry is not None and entry.versions:
                jobs.append(self._apply_into(source, report))  # running: a change rolls out
            elif only is None and source.ok and self.residency.on_demand(source):
                self._keep_cold(source, report)
            else:  # not running, and to load now: admitted under the memory budget first
                entry = self.entries.setdefault(name, ModelEntry(name))
                entry.loading = True
                is_ensemble = source.config is not None and source.config.backend == "ensemble"
                (ensembles if is_ensemble else jobs).append(self._apply_into(source, report, admit=entry))
        await asyncio.gather(*jobs)
        await asyncio.gather(*ensembles)
        self.overrides.sweep()
        if only is None:
            self.scanned = True
        if report.changed or report.failed or report.unloaded:
            log.info(
                "reconciled repository",
                changed=report.changed,
                failed=sorted(report.failed),
                unloaded=report.unloaded,
                deferred=report.deferred,
            )
        return report

    def _warn_ignored(self, source: ModelSource) -> None:
        """Config fields mpsd ignores are logged once per model and config, not on every scan."""
        if not source.warnings or self._warned.get(source.name) == source.config_fingerprint:
            return
        self._warned[source.name] = source.config_fingerprint
        log.warning("config fields ignored by mpsd", model=source.name, fields=list(source.warnings))

    async def _apply_into(
        self, source: ModelSource, report: ReconcileReport, admit: ModelEntry | None = None
    ) -> None:
        """A reconcile's step for one model, inside the model's isolation boundary: whatever fails is that
        model's, kept in its entry and in the report, and never reaches the reconcile or another model."""
        entry = admit if admit is not None else self.entries.setdefault(source.name, ModelEntry(source.name))
        try:
            with contained(entry, source.fingerprint):
                self._warn_ignored(source)
                if admit is not None:
                    why = "startup" if not self.scanned else "load"
                    changed = await self.residency.load(admit, source, why)
                else:
                    changed = await self.apply(source)
        except (LoadError, ResourceExhausted) as exc:  # the reason is logged and kept in the entry
            report.failed[source.name] = exc.message
            return
        if changed:
            report.changed.append(source.name)

    def _keep_cold(self, source: ModelSource, report: ReconcileReport) -> None:
        """A model that loads on demand: known, not started, but placed now inside its boundary, so that a
        config this host cannot honour is UNAVAILABLE with the reason from the scan on, not at the first
        request."""
        entry = self.entries.setdefault(source.name, ModelEntry(source.name))
        try:
            with contained(entry, source.fingerprint):
                self._warn_ignored(source)
                self.residency.keep_cold(entry, source)
        except LoadError as exc:
            report.failed[source.name] = exc.message

    async def load_model(self, name: str, params: LoadParameters | None = None) -> None:
        """Explicit (re)load of one model from the repository, or with the request's config and files
        (`overrides.py`): InvalidArgument, LoadRefused (not in the repository, or what the request brought
        cannot be loaded as given) or LoadError."""
        problem = model_name_problem(name)
        if problem is not None:  # before the name touches the file system: no `..`, `/`, NUL, absolute path
            raise InvalidArgument(f"model name {name!r}: {problem}")
        model_dir = self.repository / name
        if not (params is not None and params.files) and not model_dir.is_dir():
            raise LoadRefused(name)
        source, holder = await self.overrides.read(name, params, self.allow_symlinks, self.op_library_dirs)
        try:
            async with self.reconcile_lock:
                self.unloaded.discard(name)
                entry = self.entries.get(name)
                if entry is not None:
                    entry.failed_fingerprint = None  # an explicit load retries even an unchanged broken model
                self.overrides.choose(name, source, self.allow_symlinks, self.op_library_dirs)
                report = await self._reconcile([name], wait_quiet=False)
        finally:
            self.overrides.sweep(holder)
        if name in report.failed:
            raise LoadError(report.failed[name])

    async def apply(self, source: ModelSource) -> bool:
        """Bring one model in line with its source; True when something changed. Serialised per model."""
        async with self._lock(source.name):
            entry = self.entries.setdefault(source.name, ModelEntry(source.name))
            return await self.rollout.apply(entry, source)

    def _lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    async def unload_model(self, name: str, explicit: bool = False) -> None:
        """Stop routing to the model at once, let in-flight requests finish, then stop its workers.

        An explicit unload (RepositoryModelUnload) sticks: reconciles leave the model alone until it is
        loaded explicitly again.
        """
        if name not in self.entries:  # nothing to stop: done, as Triton answers (and no lock kept for it)
            return
        async with self._lock(name):
            entry = self.entries.pop(name, None)
            if entry is None:
                return
            if explicit:
                self.unloaded.add(name)
            self.overrides.forget(name)
            log.info("unloading model", model=name)
            await asyncio.gather(*(mv.unload(self.drain_timeout_s) for mv in entry.versions.values()))
            self.overrides.sweep()

    async def shutdown(self) -> None:
        """Stop every worker (requests have already drained through the gRPC server's grace period)."""
        await self.residency.stop()
        entries = list(self.entries.values())
        self.entries.clear()
        await asyncio.gather(
            *(mv.unload(0.0) for e in entries for mv in e.versions.values()),
            self.rollout.retired(),
            return_exceptions=True,
        )
        self.overrides.store.close()

    def in_flight(self) -> int:
        """Requests the models are answering now, and those waiting for a model to load."""
        return sum(e.waiting + sum(mv.inflight for mv in e.versions.values()) for e in self.entries.values())

    async def idle(self, poll_s: float = 0.02) -> None:
        """Until no request is in flight (the drain at shutdown watches it end)."""
        while self.in_flight():
            await asyncio.sleep(poll_s)

    # ---- reporting -----------------------------------------------------------------------------

    def index(self, ready_only: bool = False) -> list[IndexRow]:
        rows: list[IndexRow] = []
        for name in sorted(self.entries):
            entry = self.entries[name]
            if not entry.versions:
                state = entry.state.value
                rows.append(IndexRow(name, "", state, entry.error or entry.cold_reason or ""))
            for v in sorted(entry.versions):
                mv = entry.versions[v]
                reason = mv.reason
                if entry.error:
                    reason = f"update failed, this version keeps serving: {entry.error}"
                state = "READY" if mv.ready else mv.state.value
                if mv.state is VersionState.READY and not mv.ready:
                    state = "UNAVAILABLE"
                    reason = reason or mv.plane.lanes_down()
                rows.append(IndexRow(name, str(v), state, reason))
        if ready_only:
            rows = [r for r in rows if r.state == "READY"]
        return rows

    def versions(self, name: str) -> list[ModelVersion]:
        entry = self.entries.get(name)
        return [entry.versions[v] for v in sorted(entry.versions)] if entry else []
