"""The worker's view of the daemon's shared-memory regions: attach on first sight, drop when replaced."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from mpsd.ipc.protocol import ArenaRef, RegionRef
from mpsd.ipc.shm import Region

# Called on a freshly mapped region; returns what to call before it is unmapped (or None).
Pin = Callable[[memoryview], Callable[[], None] | None]


class RegionCache:
    """Keeps the current input and output mappings; old ones are unmapped once no tensor borrows them.

    `pin`, when given, page-locks each mapping for the device (fast, asynchronous host-device copies)
    and is undone before the mapping goes away. `views(role)` is where the caller keeps objects built on the
    current mapping of a role (tensor views, reused from request to request); they are dropped when the
    role's region is replaced, before unmapping is tried.
    """

    def __init__(self, pin: Pin | None = None) -> None:
        self._current: dict[str, Region] = {}
        self._views: dict[str, dict[object, Any]] = {}
        self._retired: list[Region] = []
        self._pin = pin
        self._unpin: dict[int, Callable[[], None]] = {}

    def get(self, role: str, ref: RegionRef) -> Region:
        region = self._current.get(role)
        if region is not None and region.name == ref.name:
            return region
        if region is not None:
            self._views.pop(role, None)
            self._retired.append(region)
        region = Region.attach(ref.name, ref.size)
        if self._pin is not None:
            undo = self._pin(region.buf)
            if undo is not None:
                self._unpin[id(region)] = undo
        self._current[role] = region
        self._retired = [r for r in self._retired if not self._close(r)]
        return region

    def views(self, role: str) -> dict[object, Any]:
        return self._views.setdefault(role, {})

    def _close(self, region: Region) -> bool:
        undo = self._unpin.pop(id(region), None)
        if undo is not None:
            undo()
        if region.close():
            return True
        if undo is not None:  # still borrowed: pin again so the next attempt finds it as before
            pinned = self._pin(region.buf) if self._pin is not None else None
            if pinned is not None:
                self._unpin[id(region)] = pinned
        return False


class Arenas:
    """The fronts' arenas this worker inherited (`Init.arenas`), mapped from their descriptors and pinned
    like the regions; pieces of inputs are read from them in place. One is unmapped when its front is gone
    (`ForgetArena`), between executions, so no execution refers to it any more."""

    def __init__(self, refs: Sequence[ArenaRef], pin: Pin | None = None) -> None:
        self._pin = pin
        self.regions: dict[int, Region] = {}
        self._unpin: dict[int, Callable[[], None]] = {}
        self.bytes: dict[int, Any] = {}  # arena id -> what the reader built on it (a tensor), dropped first
        for ref in refs:
            region = Region.from_fd(ref.fd, ref.size)
            self.regions[ref.arena_id] = region
            undo = pin(region.buf) if pin is not None else None
            if undo is not None:
                self._unpin[ref.arena_id] = undo

    def forget(self, arena_id: int) -> None:
        self.bytes.pop(arena_id, None)
        region = self.regions.pop(arena_id, None)
        if region is None:
            return
        undo = self._unpin.pop(arena_id, None)
        if undo is not None:
            undo()
        region.close()  # a tensor still borrowing it keeps the mapping; it goes with the last one
