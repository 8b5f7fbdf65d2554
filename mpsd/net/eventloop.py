"""The event loop under the daemon and its front processes: asyncio's own, or uvloop on request.

Nothing in mpsd depends on which loop runs it. uvloop (libuv) runs the same asyncio code with cheaper
callbacks, futures and transports, which helps small requests; with large requests through front processes
it measured slower (docs/performance.md), so it is a setting, not the default.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, Literal, TypeVar

from mpsd.errors import ConfigError
from mpsd.ipc.heap import keep_large_buffers_in_heap

Choice = Literal["asyncio", "uvloop"]
T = TypeVar("T")


def check(choice: Choice) -> None:
    """Asking for uvloop where it is not installed is a configuration error, found before anything starts."""
    if choice == "uvloop":
        try:
            import uvloop  # noqa: F401
        except ImportError:
            raise ConfigError("event_loop: uvloop is not installed (pip install 'mpsd[uvloop]')") from None


def run(main: Coroutine[Any, Any, T], choice: Choice) -> T:
    """Run a gRPC-serving process (the daemon, a front) on its loop, its large buffers kept in the heap."""
    keep_large_buffers_in_heap()
    if choice == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)


def loop_name() -> str:
    """The running loop, for the start-up log line."""
    return "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") else "asyncio"
