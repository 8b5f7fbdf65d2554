"""The event loop under the daemon and its front processes: uvloop where it is installed, else asyncio's.

Every request passes through several callbacks, futures and socket transports of the loop; uvloop (libuv)
runs the same asyncio code with cheaper ones. Nothing in mpsd depends on which loop runs it, so
`event_loop: asyncio` is always a safe fallback.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, Literal, TypeVar

from mpsd.errors import ConfigError

Choice = Literal["auto", "uvloop", "asyncio"]
T = TypeVar("T")


def uses_uvloop(choice: Choice) -> bool:
    """Whether `choice` means uvloop here. Asking for uvloop where it is not installed is a configuration
    error; `auto` quietly takes asyncio's loop instead."""
    if choice == "asyncio":
        return False
    try:
        import uvloop  # noqa: F401
    except ImportError:
        if choice == "uvloop":
            raise ConfigError("event_loop: uvloop is not installed (pip install uvloop)") from None
        return False
    return True


def run(main: Coroutine[Any, Any, T], choice: Choice) -> T:
    if uses_uvloop(choice):
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)


def loop_name() -> str:
    """The running loop, for the start-up log line."""
    return "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") else "asyncio"
