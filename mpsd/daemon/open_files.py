"""The daemon's open-file limit, raised at start.

Every client connection, worker socket and pipe, and shared-memory region the daemon holds is a file
descriptor. macOS starts processes, launchd jobs included, with a soft limit of 256, which a few hundred
clients exhaust; Linux's 1024 is not much more. The soft limit may be raised up to the hard one without
privileges, so the daemon does that itself, on every platform, and its workers and front processes inherit
it. macOS refuses (EINVAL) a soft limit above OPEN_MAX even under an unlimited hard limit: the ceiling is an
OS fact (`osfacts.nofile_ceiling`).
"""

from __future__ import annotations

import resource
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from mpsd import osfacts

log = structlog.get_logger("mpsd.daemon")

Get = Callable[[], tuple[int, int]]
Set = Callable[[int, int], None]


def _get() -> tuple[int, int]:
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def _set(soft: int, hard: int) -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _finite(limit: int) -> int | None:
    return None if limit == resource.RLIM_INFINITY else limit


@dataclass(frozen=True)
class OpenFiles:
    """What the start did: the soft limit before and after, the hard limit (None: unlimited), and why it
    could not be raised (None when it was, or had no need to be)."""

    before: int
    after: int
    hard: int | None
    target: int
    error: str | None = None


def goal(soft: int, hard: int | None, target: int, ceiling: int | None) -> int:
    """The soft limit wanted: `target`, within the hard limit and the system's ceiling, never below `soft`
    (a limit someone raised further is theirs). A target of 0 keeps `soft`."""
    if target <= 0:
        return soft
    wanted = min(limit for limit in (target, hard, ceiling) if limit is not None)
    return max(soft, wanted)


def raise_open_files(target: int, get: Get = _get, set_limit: Set = _set) -> OpenFiles:
    """Raise the soft RLIMIT_NOFILE towards `target`; a refusal is reported, not raised."""
    soft, hard = get()
    finite_hard = _finite(hard)
    new = goal(soft, finite_hard, target, osfacts.current().nofile_ceiling)
    if new == soft:
        return OpenFiles(soft, soft, finite_hard, target)
    try:
        set_limit(new, hard)
    except (OSError, ValueError) as exc:
        return OpenFiles(soft, get()[0], finite_hard, target, error=str(exc) or type(exc).__name__)
    return OpenFiles(soft, get()[0], finite_hard, target)


def tell(done: OpenFiles) -> None:
    """What `raise_open_files` did, in one event: the limit before and after, or why it stayed. Told once the
    daemon listens, so a start refused at once (a port in use) stays the one line that says why."""
    target = done.target
    fields = {
        "before": done.before,
        "after": done.after,
        "hard": "unlimited" if done.hard is None else done.hard,
        "target": target,
    }
    if done.error is not None:
        log.warning("open file limit not raised", reason=done.error, **fields)
    else:
        log.info("open file limit", **fields)
