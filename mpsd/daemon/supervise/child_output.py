"""The lines a child process (worker or front) writes to a pipe, for the daemon to log as its own."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable


async def output_lines(stream: asyncio.StreamReader, too_long: Callable[[], None]) -> AsyncIterator[str]:
    """Each line, decoded and without its line end, until the pipe closes.

    A line over the stream's limit is dropped and `too_long` says so; reading goes on. Ending there instead
    would leave the child blocked on a full pipe later, stuck on its next write.
    """
    while True:
        try:
            line = await stream.readline()
        except ValueError:
            too_long()
            continue
        if not line:
            return
        yield line.decode(errors="replace").rstrip()
