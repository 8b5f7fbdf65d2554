"""What is loaded and where requests go: model entries, their serving versions, load/unload with swap.

A new version set is started and warmed up beside the old one, routing switches in one assignment, and
the old versions drain in the background; a failed load leaves the old versions serving.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import structlog

from mpsd.config.model_config import ModelConfig
from mpsd.config.repository import ModelSource, model_name_problem, scan_repository
from mpsd.daemon.core.model_version import ModelVersion, VersionState
from mpsd.daemon.supervise.instance import SupervisorSettings
from mpsd.daemon.supervise.launch import plan_version
from mpsd.daemon.supervise.placement import (
    BudgetPolicy,
    check_memory_budget,
    counts_resize_in_place,
    enforce_memory_budget,
)
from mpsd.errors import ConfigError, InvalidArgument, LoadError, NotFound, Unavailable

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

    @property
    def state(self) -> ModelState:
        if any(v.ready for v in self.versions.values()):
            return ModelState.READY
        if self.loading:
            return ModelState.LOADING
        return ModelState.UNAVAILABLE


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


def _settling(model_dir: Path, quiet_period_s: float) -> bool:
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
    ) -> None:
        self.repository = repository
        self.budget_policy = budget_policy
        self.quiet_period_s = quiet_period_s
        self.allow_symlinks = False  # follow symlinks that leave the repository
        self._warned: dict[str, str] = {}  # model -> config fingerprint whose ignored fields were logged
        self.unloaded: set[str] = set()
        self.reconcile_lock = asyncio.Lock()
        self._loading: dict[str, ModelVersion] = {}
        self.settings = settings
        self.drain_timeout_s = drain_timeout_s
        self.entries: dict[str, ModelEntry] = {}
        # Until the first full scan, `entries` is empty because nothing was read yet, not because the
        # repository is empty: the server is not ready then (front processes and gRPC listen earlier).
        self.scanned = False
        self._locks: dict[str, asyncio.Lock] = {}
        self._background: set[asyncio.Task[None]] = set()

    # ---- routing -------------------------------------------------------------------------------

    def route(self, name: str, version: str) -> ModelVersion:
        """The version that answers a request for (name, version); "" means the latest serving one."""
        entry = self.entries.get(name)
        if entry is None:
            raise NotFound(f"unknown model '{name}'")
        if not entry.versions:
            reason = f": {entry.error}" if entry.error else f" ({entry.state.value.lower()})"
            raise Unavailable(f"model '{name}' is not available{reason}")
        if version == "":
            return entry.versions[max(entry.versions)]
        if not (version.isascii() and version.isdigit()):
            raise NotFound(f"model '{name}' has no version '{version}' (versions are positive integers)")
        found = entry.versions.get(int(version))
        if found is None:
            have = ", ".join(str(v) for v in sorted(entry.versions))
            raise NotFound(f"model '{name}' has no version {version} (available: {have})")
        return found

    def model_ready(self, name: str, version: str = "") -> bool:
        try:
            return self.route(name, version).ready
        except (NotFound, Unavailable):
            return False

    def server_ready(self) -> bool:
        """The repository has been read and every model it holds is ready (Triton's strict readiness)."""
        return self.scanned and all(e.state is ModelState.READY for e in self.entries.values())

    # ---- loading -------------------------------------------------------------------------------

    async def reconcile(self, only: Collection[str] | None = None, settle: bool = True) -> ReconcileReport:
        """Compare what the repository says now with what runs, and act. Idempotent.

        `only` limits the step to some models (RepositoryModelLoad); models unloaded by an operator stay
        unloaded until loaded again explicitly.
        """
        async with self.reconcile_lock:
            return await self._reconcile(only, settle)

    async def _reconcile(self, only: Collection[str] | None, settle: bool) -> ReconcileReport:
        desired = scan_repository(self.repository, self.allow_symlinks)
        report = ReconcileReport()
        names = sorted(set(only) if only is not None else set(desired) | set(self.entries))
        jobs = []
        for name in names:
            source = desired.get(name)
            if only is None and name in self.unloaded:
                continue
            if source is None:
                if name in self.entries:
                    report.unloaded.append(name)
                    jobs.append(self.unload_model(name))
                continue
            if settle and _settling(source.path, self.quiet_period_s):
                report.deferred.append(name)
                continue
            self.entries.setdefault(name, ModelEntry(name, loading=True))
            jobs.append(self._apply_into(source, report))
        await asyncio.gather(*jobs)
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

    async def _apply_into(self, source: ModelSource, report: ReconcileReport) -> None:
        self._warn_ignored(source)
        try:
            if await self.apply(source):
                report.changed.append(source.name)
        except LoadError as exc:  # the reason is logged and kept in the index
            report.failed[source.name] = str(exc)

    async def load_model(self, name: str) -> None:
        """Explicit (re)load of one model from the repository: InvalidArgument, NotFound or LoadError."""
        problem = model_name_problem(name)
        if problem is not None:  # before the name touches the file system: no `..`, `/`, NUL, absolute path
            raise InvalidArgument(f"model name {name!r}: {problem}")
        model_dir = self.repository / name
        if not model_dir.is_dir():
            raise NotFound(f"model '{name}' is not in the repository {self.repository}")
        self.unloaded.discard(name)
        entry = self.entries.get(name)
        if entry is not None:
            entry.failed_fingerprint = None  # an explicit load retries even an unchanged broken model
        report = await self.reconcile(only=[name], settle=False)
        if name in report.failed:
            raise LoadError(report.failed[name])

    async def apply(self, source: ModelSource) -> bool:
        """Bring one model in line with its source; True when something changed. Serialised per model."""
        async with self._lock(source.name):
            return await self._apply(source)

    async def _apply(self, source: ModelSource) -> bool:
        entry = self.entries.setdefault(source.name, ModelEntry(source.name))
        fingerprint = source.fingerprint
        if entry.error is not None and entry.failed_fingerprint == fingerprint:
            entry.loading = False
            raise LoadError(entry.error)  # unchanged since it failed: do not restart workers in a loop
        if not source.ok:
            self._fail(entry, source.error or "invalid model", fingerprint)
        assert source.config is not None
        keep: dict[int, ModelVersion] = {}
        fresh: list[ModelVersion] = []
        resized: list[tuple[ModelVersion, ModelConfig]] = []
        try:
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
                        source.name, v, source.config, version_fp, placements, launches, self.settings
                    )
                )
            retiring = [mv for v, mv in entry.versions.items() if keep.get(v) is not mv]
            side_by_side = self._check_budget(entry.name, fresh, retiring, resized, source)
        except ConfigError as exc:
            self._fail(entry, exc.message, fingerprint)
        # Held from the check until the versions run (or fail), so models loading at the same time count
        # against each other's budget.
        for mv in fresh:
            self._loading[mv.label] = mv
        try:
            return await self._start(entry, source, fingerprint, keep, fresh, retiring, resized, side_by_side)
        finally:
            for mv in fresh:
                self._loading.pop(mv.label, None)

    async def _start(
        self,
        entry: ModelEntry,
        source: ModelSource,
        fingerprint: str,
        keep: dict[int, ModelVersion],
        fresh: list[ModelVersion],
        retiring: list[ModelVersion],
        resized: list[tuple[ModelVersion, ModelConfig]],
        side_by_side: bool,
    ) -> bool:
        for mv, config in resized:
            placements, launches = plan_version(source, mv.version)
            try:
                await mv.resize(config, (source.config_fingerprint, mv.fingerprint[1]), placements, launches)
            except LoadError as exc:
                self._fail(entry, str(exc), fingerprint)
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
            self._fail(entry, str(failures[0]), fingerprint)
        retired = [mv for v, mv in entry.versions.items() if keep.get(v) is not mv]
        entry.versions = {**keep, **{mv.version: mv for mv in fresh}}
        entry.source, entry.error, entry.loading = source, None, False
        entry.failed_fingerprint = None
        for mv in retired:
            self._spawn(mv.unload(self.drain_timeout_s))
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
            for entry in self.entries.values()
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

    def _lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    def _fail(self, entry: ModelEntry, reason: str, fingerprint: str) -> NoReturn:
        entry.error = reason
        entry.failed_fingerprint = fingerprint
        entry.loading = False
        if entry.versions:
            log.error("model update failed; previous version keeps serving", model=entry.name, reason=reason)
        else:
            log.error("model failed to load", model=entry.name, reason=reason)
        raise LoadError(reason)

    def _spawn(self, coro: object) -> None:
        task: asyncio.Task[None] = asyncio.create_task(coro)  # type: ignore[arg-type]
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def unload_model(self, name: str, explicit: bool = False) -> None:
        """Stop routing to the model at once, let in-flight requests finish, then stop its workers.

        An explicit unload (RepositoryModelUnload) sticks: reconciles leave the model alone until it is
        loaded explicitly again.
        """
        async with self._lock(name):
            entry = self.entries.pop(name, None)
            if entry is None:
                raise NotFound(f"unknown model '{name}'")
            if explicit:
                self.unloaded.add(name)
            log.info("unloading model", model=name)
            await asyncio.gather(*(mv.unload(self.drain_timeout_s) for mv in entry.versions.values()))

    async def shutdown(self) -> None:
        """Stop every worker (requests have already drained through the gRPC server's grace period)."""
        entries = list(self.entries.values())
        self.entries.clear()
        await asyncio.gather(
            *(mv.unload(0.0) for e in entries for mv in e.versions.values()),
            *self._background,
            return_exceptions=True,
        )

    # ---- reporting -----------------------------------------------------------------------------

    def index(self, ready_only: bool = False) -> list[IndexRow]:
        rows: list[IndexRow] = []
        for name in sorted(self.entries):
            entry = self.entries[name]
            if not entry.versions:
                state = entry.state.value
                rows.append(IndexRow(name, "", state, entry.error or ""))
            for v in sorted(entry.versions):
                mv = entry.versions[v]
                reason = mv.reason
                if entry.error:
                    reason = f"update failed, this version keeps serving: {entry.error}"
                state = "READY" if mv.ready else mv.state.value
                if mv.state is VersionState.READY and not mv.ready:
                    state = "UNAVAILABLE"
                    reason = reason or mv._why().lstrip(": ")
                rows.append(IndexRow(name, str(v), state, reason))
        if ready_only:
            rows = [r for r in rows if r.state == "READY"]
        return rows

    def versions(self, name: str) -> list[ModelVersion]:
        entry = self.entries.get(name)
        return [entry.versions[v] for v in sorted(entry.versions)] if entry else []
