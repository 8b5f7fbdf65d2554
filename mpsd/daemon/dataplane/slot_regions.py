"""The shared memory of one execution slot of a worker: an input region and an output region, owned by the
daemon (a worker has `SLOTS` of them).

Not to be confused with a front process's arena (`ipc/front_arena.py`), which holds requests on their way from
a front to the daemon.

Regions are reused from request to request and only replaced (by one twice as large) when a request does
not fit, so no request allocates shared memory. Names are unlinked once the worker has mapped them.
"""

from __future__ import annotations

from mpsd.ipc.protocol import RegionRef
from mpsd.ipc.shm import Region, page_round

INITIAL_REGION = 1 << 20


class SlotRegions:
    def __init__(self) -> None:
        self.input: Region | None = None
        self.output: Region | None = None
        self._mapped: list[Region] = []

    def input_for(self, nbytes: int) -> Region:
        """The input region, replaced by a larger one first if `nbytes` do not fit."""
        if self.input is None or self.input.size < nbytes:
            old = self.input
            self.input = self._new(max(nbytes, INITIAL_REGION, 2 * (old.size if old else 0)))
            if old is not None:
                self._retire(old)
        return self.input

    def output_region(self) -> Region:
        if self.output is None:
            self.output = self._new(INITIAL_REGION)
        return self.output

    def grow_output(self, nbytes: int) -> RegionRef:
        """A larger output region for the request in progress (the worker asked with NeedOutput)."""
        old = self.output
        self.output = self._new(max(nbytes, 2 * (old.size if old else 0)))
        if old is not None:
            self._retire(old)
        return ref(self.output)

    def mapped_by_worker(self) -> None:
        """The worker answered a request using both regions: their names are no longer needed."""
        for region in (self.input, self.output):
            if region is not None:
                region.unlink()

    def release(self) -> None:
        for region in self._mapped:
            region.unlink()
            region.close()
        self._mapped.clear()
        self.input = self.output = None

    def _new(self, size: int) -> Region:
        region = Region.create(page_round(size))
        self._mapped.append(region)
        return region

    def _retire(self, region: Region) -> None:
        region.unlink()
        if region.close():
            self._mapped.remove(region)


def ref(region: Region) -> RegionRef:
    return RegionRef(region.name, region.size)
