"""Choosing what to unload so that a model fits: idle models, least recently used first.

Pure: the caller says what each resident model holds and whether it may go; the choice is tested alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from mpsd.daemon.core.residency.footprint import Footprint


@dataclass(frozen=True)
class Holder:
    """A model that holds memory now (resident, or loading)."""

    name: str
    footprint: Footprint
    last_used: float  # time.monotonic()
    kept_because: str | None  # None: it may be evicted; else why not (pinned, in use, loaded 3 s ago, ...)


@dataclass(frozen=True)
class Shortfall:
    """No choice of idle models frees enough on `device`."""

    device: str
    needed: int
    budget: int
    free: int  # with every idle model gone
    holders: tuple[Holder, ...]

    def message(self, model: str) -> str:
        held = ", ".join(
            f"{h.name} ({gib(h.footprint.by_device.get(self.device, 0))}, {h.kept_because or 'idle'})"
            for h in self.holders
        )
        return (
            f"model '{model}' needs {gib(self.needed)} on {self.device}; its budget is {gib(self.budget)}, "
            f"of which {gib(self.free)} can be freed or is free; held by: {held or 'nothing'}"
        )


def gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def choose_victims(
    need: Footprint, budgets: Mapping[str, int | None], holders: list[Holder]
) -> list[Holder] | Shortfall:
    """The idle holders to unload, least recently used first, so that `need` fits every budget."""
    victims: list[Holder] = []
    for device, needed in sorted(need.by_device.items()):
        budget = budgets.get(device)
        if budget is None or needed == 0:
            continue
        on_device = [h for h in holders if h.footprint.by_device.get(device, 0) > 0]

        def held(gone: list[Holder], on: list[Holder] = on_device, dev: str = device) -> int:
            return sum(h.footprint.by_device[dev] for h in on if h not in gone)

        candidates = sorted(
            (h for h in on_device if h.kept_because is None and h not in victims), key=lambda h: h.last_used
        )
        while budget - held(victims) < needed and candidates:
            victims.append(candidates.pop(0))
        if budget - held(victims) < needed:
            freeable = budget - held([h for h in on_device if h.kept_because is None])
            return Shortfall(device, needed, budget, freeable, tuple(on_device))
    return victims
