"""The fronts' arenas, for the workers to read request bytes in place.

A large request that comes through a front lies in its arena; copying it from there into a worker's input
region took half of the daemon's main thread with ResNet-50 at saturation (300 KB per image), and helper
threads could not take the copy over (the GIL). Instead, a worker started while an arena exists inherits
its descriptor, maps it (page-locked on a CUDA device), and takes those bytes straight from it: the daemon
sends where they are (`Piece`) and copies nothing. A worker started before an arena (a front restarted
since) does not have it: the daemon copies those bytes as before.

The arena's chunk stays the call's until the daemon answers it, so it cannot change under the worker,
except for a call whose client went away: its rows may then be read from a chunk in use for another call,
and nobody reads that call's results.
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
from collections.abc import Callable, Collection
from dataclasses import dataclass

import numpy as np

from mpsd.ipc import protocol as p
from mpsd.ipc.shm import Region


def address(buf: memoryview) -> int:
    """Where a buffer's first byte is in this process's memory: through ctypes for a writable buffer
    (an arena's bytes; a fifth of numpy's cost, and this runs for every large input), through numpy
    otherwise."""
    if not buf.readonly and buf.nbytes and buf.c_contiguous:
        return ctypes.addressof(ctypes.c_char.from_buffer(buf))
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


@dataclass(frozen=True)
class Arena:
    arena_id: int
    region: Region
    start: int  # the mapping's address
    end: int


class ArenaBook:
    """The daemon's live arenas by id, which workers to tell when one goes (`forgotten` callbacks), and
    where a buffer lies among the arenas a worker has mapped."""

    def __init__(self) -> None:
        self._arenas: dict[int, Arena] = {}
        # The live arenas by where they start, for `locate` to find a buffer's with one bisection (a
        # request's input, with a front each, is looked up among them all).
        self._starts: list[int] = []
        self._by_start: list[Arena] = []
        self._ids = itertools.count(1)
        self._listeners: list[Callable[[int], None]] = []

    def add(self, region: Region) -> int:
        """A front's new arena (its region keeps its descriptor open for the workers to inherit)."""
        arena_id = next(self._ids)
        start = address(region.buf)
        self._arenas[arena_id] = Arena(arena_id, region, start, start + region.size)
        self._sort()
        return arena_id

    def _sort(self) -> None:
        self._by_start = sorted(self._arenas.values(), key=lambda a: a.start)
        self._starts = [a.start for a in self._by_start]

    def remove(self, arena_id: int) -> None:
        """The arena's front is gone: workers that mapped it are told to unmap it."""
        if self._arenas.pop(arena_id, None) is not None:
            self._sort()
            for forgotten in list(self._listeners):
                forgotten(arena_id)

    def refs(self) -> list[p.ArenaRef]:
        """For a worker about to start: each live arena as Init names it (its `fd` is the one to pass)."""
        return [
            p.ArenaRef(a.arena_id, a.region.fd, a.region.size)
            for a in self._arenas.values()
            if a.region.fd is not None
        ]

    def listen(self, forgotten: Callable[[int], None]) -> Callable[[], None]:
        """Call `forgotten(arena_id)` when an arena goes; returns what stops that."""
        self._listeners.append(forgotten)
        return lambda: self._listeners.remove(forgotten) if forgotten in self._listeners else None

    def locate(self, data: memoryview, mapped: Collection[int]) -> tuple[int, int] | None:
        """(arena id, offset) of `data` when it lies whole in one of the `mapped` arenas, else None."""
        if not mapped:
            return None
        at = address(data)
        i = bisect.bisect_right(self._starts, at) - 1
        if i < 0:
            return None
        arena = self._by_start[i]  # the one that starts last at or before it: mappings do not overlap
        if at + data.nbytes <= arena.end and arena.arena_id in mapped:
            return arena.arena_id, at - arena.start
        return None


ARENAS = ArenaBook()  # the daemon's one book: the front pool adds to it, workers' channels read it


class WorkerArenas:
    """The arenas one worker has mapped (those in its Init), as its channel uses them: where an input's
    bytes are (`place`), how many it took in place, and `forget(arena_id)` called when one goes (the channel
    tells the worker)."""

    def __init__(self, forget: Callable[[int], None]) -> None:
        self.mapped: set[int] = set()
        self.in_place_bytes = 0  # input bytes the worker took from them itself
        self._forget = forget
        self._unlisten: Callable[[], None] = lambda: None

    def map(self, arenas: Collection[p.ArenaRef]) -> None:
        self.mapped = {a.arena_id for a in arenas}
        if self.mapped:
            self._unlisten = ARENAS.listen(self._gone)

    def _gone(self, arena_id: int) -> None:
        if arena_id in self.mapped:
            self.mapped.discard(arena_id)
            self._forget(arena_id)

    def place(self, data: memoryview) -> tuple[int, int] | None:
        return ARENAS.locate(data, self.mapped)

    def close(self) -> None:
        """The worker is gone: nothing more goes to it in place."""
        self._unlisten()
        self.mapped = set()
