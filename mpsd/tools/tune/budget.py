"""Whether a trial fits the device's memory budget, checked before its load.

A load that changes a running model is not admitted by the daemon's residency (docs/memory.md): the new
config rolls out beside the old one and is never refused for memory, so the tuner refuses such trials
itself. It counts what other models hold, the running config (it serves until the new one is ready, unless
only the instance count changes: then workers are added or removed in place), and the new config's
instances at their declared or capped footprint, else the largest size one of this model's workers has
reported so far. Nothing is evicted for a
trial, pinned or not: a trial that does not fit beside what is loaded is reported as refused.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from mpsd.tools.tune.trials import Settings

GIB = 1 << 30


class Budget:
    def __init__(self, model: str) -> None:
        self.model = model
        self.largest_worker = 0  # bytes: the largest this model's workers have reported

    def observe(self, per_worker: list[int]) -> None:
        self.largest_worker = max([self.largest_worker, *per_worker])

    def refusal(self, listing: Any, running: Settings, trial: Settings) -> str:
        """Why `trial` would not fit (empty when it fits, or when no budget or size is known)."""
        mine = next((r for r in listing.residency if r.model == self.model), None)
        if mine is None:
            return ""
        in_place = replace(running, instances=trial.instances) == trial
        for device, held in mine.footprint.items():
            budget = next((b for b in listing.budgets if b.device == device), None)
            if budget is None or not budget.HasField("budget_bytes"):
                continue
            per_instance = held // max(running.instances, 1)
            if mine.footprint_basis not in ("declared", "cap"):  # what the daemon counts, else measured
                per_instance = max(per_instance, self.largest_worker)
            if per_instance <= 0:
                continue
            others = budget.resident_bytes - held
            need = per_instance * trial.instances
            during = others + need + (0 if in_place else held)
            if during > budget.budget_bytes:
                beside = "" if in_place else f" + {held / GIB:.2f} GiB running until it is ready"
                return (
                    f"needs about {need / GIB:.2f} GiB on {device}{beside}, other models hold "
                    f"{others / GIB:.2f} GiB, budget {budget.budget_bytes / GIB:.2f} GiB"
                )
        return ""
