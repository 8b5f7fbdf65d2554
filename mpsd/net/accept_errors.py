"""A listening socket that cannot accept (out of file descriptors): one log event a second, not thousands.

asyncio's accept loop reports each failed accept() to the loop's exception handler, and on Python 3.11 it
goes on trying the rest of its backlog after the first failure, so an aiohttp port under more clients than
the open-file limit allows wrote about 700 lines a second, each with a traceback. The connections are not
lost: they wait in the kernel's queue, and asyncio tries again a second later. This handler tells the
condition once per interval, with the count of the failures held back, and passes every other exception to
the loop's default handler.
"""

from __future__ import annotations

import asyncio
import errno
from collections.abc import Callable
from typing import Any

import structlog

from mpsd.net.log_rate import Throttle

log = structlog.get_logger("mpsd.daemon")

# What accept() fails with when the process or the system is out of descriptors or memory (asyncio's list).
OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
HINT = "raise open_files in the daemon config, or the hard open-file limit (ulimit -Hn, the service's limits)"

Handler = Callable[[asyncio.AbstractEventLoop, dict[str, Any]], object]


def is_accept_error(context: dict[str, Any]) -> bool:
    exc = context.get("exception")
    return (
        isinstance(exc, OSError)
        and exc.errno in OUT_OF_RESOURCES
        and "accept" in str(context.get("message", ""))
    )


class AcceptErrors:
    """The loop's exception handler: accept failures through a `Throttle`, the rest to `fallback`."""

    def __init__(self, throttle: Throttle, fallback: Handler) -> None:
        self.throttle = throttle
        self.fallback = fallback
        self._timer: asyncio.TimerHandle | None = None
        self._last: dict[str, Any] = {}

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if not is_accept_error(context):
            self.fallback(loop, context)
            return
        self._last = context
        held = self.throttle.admit()
        if held is not None:
            self._tell(context, held)
        elif self._timer is None:  # the count is told at the interval's end, should no failure follow
            self._timer = loop.call_later(self.throttle.wait_s(), self._flush)

    def _flush(self) -> None:
        self._timer = None
        held = self.throttle.flush()
        if held:  # the last failure held back is told, the others counted: failures = events + suppressed
            self._tell(self._last, held - 1)

    def _tell(self, context: dict[str, Any], suppressed: int) -> None:
        exc = context["exception"]
        log.error(
            "accepting connections failed",
            reason=exc.strerror or str(exc),
            errno=errno.errorcode.get(exc.errno, exc.errno),
            address=_address(context.get("socket")),
            suppressed=suppressed,
            hint=HINT,
        )


def _address(sock: Any) -> str | None:
    """The listening socket's address as host:port or a path; None when it cannot be told."""
    try:
        name = sock.getsockname() if sock is not None else None
    except OSError:
        return None
    if isinstance(name, tuple):
        return f"{name[0]}:{name[1]}"
    return str(name) if name else None


def install(loop: asyncio.AbstractEventLoop, throttle: Throttle | None = None) -> AcceptErrors:
    """Make the loop's exception handler tell accept failures at most once per second."""
    handler = AcceptErrors(throttle or Throttle(), lambda lp, ctx: lp.default_exception_handler(ctx))
    loop.set_exception_handler(handler)
    return handler
