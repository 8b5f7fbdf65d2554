"""A front's stderr into the daemon's log: its events become the daemon's own."""

from __future__ import annotations

import asyncio
import json

import structlog

from mpsd.daemon.supervise.child_output import output_lines
from mpsd.logs.levels import SEVERITIES

log = structlog.get_logger("mpsd.daemon.supervise.fronts")

LOG_LINE_LIMIT = 1 << 20  # a front's log line (a JSON event, a traceback on one line) up to 1 MiB
FRONT_LOG_LEVELS = frozenset(SEVERITIES)


async def relay_front_log(stream: asyncio.StreamReader, index: int, pid: int) -> None:
    """A front's log events become the daemon's own: rendered in the daemon's format, filtered at its level
    (which the front follows, so it writes only what passes), and in the event stream `mpsd logs` reads.
    The front writes them as JSON lines; any other line on its stderr (a traceback from a crash) is relayed
    as text."""

    def too_long() -> None:
        log.warning("front log line too long; dropped", front=index, pid=pid, limit=LOG_LINE_LIMIT)

    async for text in output_lines(stream, too_long):
        if not text:
            continue
        try:
            fields = json.loads(text)
        except ValueError:
            fields = None
        if not isinstance(fields, dict) or not isinstance(fields.get("event"), str):
            log.warning(text, source="front.stderr", front=index, pid=pid, event_kind="stderr")
            continue
        message = fields.pop("event")
        level = str(fields.pop("level", "info"))
        fields.pop("timestamp", None)
        fields.setdefault("front", index)
        emit = getattr(log, level if level in FRONT_LOG_LEVELS else "info")
        emit(message, **{**fields, "source": "front", "pid": pid})
