"""What the status page shows, as one JSON document: every model with its state, instances, residency and
recent requests, each device's budget and who holds it, and the latest events.

Read from the daemon's own state when asked (the registry, residency, the recent-activity window, the
event bus), like the metrics and `ListWorkers`, so a page left open costs inference nothing.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import asdict
from typing import Any

import mpsd
from mpsd.daemon.api.recent import RecentActivity
from mpsd.daemon.core.model_version import ModelVersion, VersionInstance
from mpsd.daemon.core.registry import ModelEntry, Registry
from mpsd.daemon.dataplane.stats import VersionStats
from mpsd.logs.events import BUS, EventBus, EventFilter

EVENTS = 50  # the latest events shown, at info level and above
_SHOWN_EVENTS = EventFilter(level="info")


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def _device(instance: VersionInstance, mv: ModelVersion) -> str:
    """The device the worker runs on (`cuda:0`, `mps`, `cpu`): as it reported it once ready, else where
    it was placed."""
    worker = instance.worker
    if worker is not None and worker.ready is not None:
        kind = str(worker.ready.device.get("kind") or "")
        index = worker.ready.device.get("index")
        if kind:
            return f"{kind}:{index}" if index is not None else kind
    index = instance.launch.instance
    return mv.placements[index].device_key if index < len(mv.placements) else ""


def _instance(mv: ModelVersion, instance: VersionInstance, now: float) -> dict[str, Any]:
    worker = instance.worker
    running = worker is not None and worker.returncode is None and not worker.died.is_set()
    return {
        "version": mv.version,
        "instance": instance.launch.instance,
        "kind": instance.launch.kind,
        "device": _device(instance, mv),
        "state": instance.state,
        "pid": (worker.pid or 0) if worker is not None and running else 0,
        "restarts": instance.restarts,
        "uptime_s": _round(now - instance.started_at, 1) if instance.ready and instance.started_at else None,
        "last_exit": instance.last_exit or "",
        "last_error": instance.last_error or "",
    }


class StatusView:
    def __init__(self, registry: Registry, server_name: str = "mpsd", bus: EventBus = BUS) -> None:
        self.registry = registry
        self.server_name = server_name
        self.bus = bus
        self.recent = RecentActivity(self._stats)
        self._started = time.monotonic()

    def _stats(self) -> dict[str, Iterable[VersionStats]]:
        return {name: [mv.stats for mv in e.versions.values()] for name, e in self.registry.entries.items()}

    def document(self) -> dict[str, Any]:
        """The page's data now."""
        now = time.monotonic()
        registry = self.registry
        figures = self.recent.figures()
        rows: dict[str, list[dict[str, str]]] = {}
        for row in registry.index():
            rows.setdefault(row.name, []).append(
                {"version": row.version, "state": row.state, "reason": row.reason}
            )
        models = []
        for name in sorted(registry.entries):
            entry = registry.entries[name]
            model = self._model(entry, rows.get(name, []), now)
            found = figures.get(name)
            if found is not None:
                model["requests"] = {
                    "window_s": _round(found.window_s, 1),
                    "per_s": _round(found.requests_per_s),
                    "failures_per_s": _round(found.failures_per_s),
                    "p50_ms": _round(q * 1e3 if (q := found.quantiles_s[0.5]) is not None else None),
                    "p99_ms": _round(q * 1e3 if (q := found.quantiles_s[0.99]) is not None else None),
                    "series": [_round(x) for x in found.series],
                    "step_s": self.recent.step_s,
                }
            models.append(model)
        return {
            "server": {
                "name": self.server_name,
                "version": mpsd.__version__,
                "ready": registry.server_ready(),
                "uptime_s": round(now - self._started, 1),
                "time": time.time(),
            },
            "devices": self._devices(),
            "models": models,
            "window_s": self.recent.window_s,  # the window's length (a model's figures: as much as is kept)
            "events": [asdict(e) for e in self.bus.recent(_SHOWN_EVENTS, EVENTS)],
        }

    def _model(self, entry: ModelEntry, rows: list[dict[str, str]], now: float) -> dict[str, Any]:
        residency = self.registry.residency
        policy = residency.policy(entry)
        footprint = residency.shown_footprint(entry)
        versions = [entry.versions[v] for v in sorted(entry.versions)]
        resident = bool(entry.versions)
        return {
            "name": entry.name,
            "state": entry.state.value,
            "reason": next((r["reason"] for r in rows if r["reason"]), ""),
            "versions": rows,
            "instances": [_instance(mv, i, now) for mv in versions for i in mv.instances],
            "pending": entry.waiting + sum(mv.inflight for mv in versions),
            "residency": {
                "resident": resident,
                "load": policy.load,
                "keep_alive": policy.describe_keep_alive(),
                "pinned": policy.pinned,
                "idle_s": _round(now - entry.last_used, 1) if resident and entry.last_used else None,
                "loaded_s": _round(now - entry.loaded_at, 1) if resident and entry.loaded_at else None,
            },
            "footprint": dict(footprint.by_device) if footprint is not None else {},
            "footprint_basis": footprint.basis if footprint is not None else "",
        }

    def _devices(self) -> list[dict[str, Any]]:
        """Each device's budget, what is held of it, and by which loaded model (the rest: loads under way)."""
        residency = self.registry.residency
        held = residency.resident_bytes()
        by_model: dict[str, dict[str, int]] = {}
        for name, entry in sorted(self.registry.entries.items()):
            if entry.versions:
                for device, nbytes in residency.entry_footprint(entry).by_device.items():
                    by_model.setdefault(device, {})[name] = nbytes
        return [
            {
                "device": device,
                "budget_bytes": budget,
                "resident_bytes": held.get(device, 0),
                "models": by_model.get(device, {}),
            }
            for device, budget in residency.budgets().items()
        ]
