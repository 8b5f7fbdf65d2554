"""The worker's view of the daemon's shared-memory regions: attach on first sight, drop when replaced."""

from __future__ import annotations

from mpsd.ipc.protocol import RegionRef
from mpsd.ipc.shm import Region


class RegionCache:
    """Keeps the current input and output mappings; old ones are unmapped once no tensor borrows them."""

    def __init__(self) -> None:
        self._current: dict[str, Region] = {}
        self._retired: list[Region] = []

    def get(self, role: str, ref: RegionRef) -> Region:
        region = self._current.get(role)
        if region is not None and region.name == ref.name:
            return region
        if region is not None:
            self._retired.append(region)
        region = Region.attach(ref.name, ref.size)
        self._current[role] = region
        self._retired = [r for r in self._retired if not r.close()]
        return region
