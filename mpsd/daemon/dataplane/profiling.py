"""The daemon's side of one profile of one worker (`mpsd profile`): what the worker sends for it, in order.

The channel holds at most one `ProfileRun` per worker: a second is refused before anything is sent. The
worker's answers (ProfileStarted or ProfileFailed, then ProfileChunk frames and ProfileDone) are queued
here as they arrive, and the caller reads them at its own pace.
"""

from __future__ import annotations

import asyncio

from mpsd.errors import MpsdError
from mpsd.ipc import protocol as p

Item = p.ProfileStarted | p.ProfileChunk | p.ProfileDone | p.ProfileFailed | MpsdError


class ProfileRun:
    def __init__(self, profile_id: int) -> None:
        self.profile_id = profile_id
        self.finished = False  # ProfileDone or ProfileFailed arrived, or the worker died
        self._items: asyncio.Queue[Item] = asyncio.Queue()

    def deliver(self, msg: object) -> None:
        """A profile message from the worker (the channel has matched its id)."""
        if self.finished:
            return
        if isinstance(msg, (p.ProfileStarted, p.ProfileChunk, p.ProfileDone, p.ProfileFailed)):
            self.finished = isinstance(msg, (p.ProfileDone, p.ProfileFailed))
            self._items.put_nowait(msg)

    def fail(self, error: MpsdError) -> None:
        """The worker is gone: the reader gets `error`."""
        if not self.finished:
            self.finished = True
            self._items.put_nowait(error)

    async def next(self) -> Item:
        return await self._items.get()
