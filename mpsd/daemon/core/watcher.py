"""Watching the model repository: inotify on Linux, FSEvents on macOS (through watchfiles), or polling.

Events only wake the reconciler, after a quiet period with no further changes, so a directory being copied
is looked at once the copy has gone quiet.

The repository is watched by its real path (symlinks resolved): FSEvents names changed files by their real
paths (macOS's /tmp and /var are symlinks), and a path that still does not fall under it is logged and
skipped, never allowed to end the watch.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import structlog
import watchfiles

from mpsd.config.repository import is_ignored_name

log = structlog.get_logger("mpsd.daemon.watch")


def _relevant(change: watchfiles.Change, path: str) -> bool:
    """Editor swap files, dotfiles, partial downloads and bytecode caches never trigger a reload."""
    parts = Path(path).parts
    return not any(is_ignored_name(p) or p == "__pycache__" for p in parts[-4:])


def watched_root(repository: Path) -> Path:
    """The repository's real path, which the watch is given and events are compared with."""
    return Path(os.path.realpath(repository))


def model_of(root: Path, path: str) -> str | None:
    """The top folder under the (resolved) `root` that a changed `path` is in; None for the root itself,
    and for a path outside it (logged: it is only left out of the log line, the reconciler still wakes)."""
    for candidate in (path, os.path.realpath(path)):  # a model folder may itself be a link
        try:
            parts = Path(candidate).relative_to(root).parts
        except ValueError:
            continue
        return parts[0] if parts else None
    log.warning("changed path outside the repository", path=path, repository=str(root))
    return None


async def watch_repository(
    repository: Path, wake: Callable[[str], None], quiet_period_s: float, poll_interval_s: float | None
) -> None:
    """Run until cancelled; `poll_interval_s` set means polling instead of native events."""
    quiet_ms = max(int(quiet_period_s * 1000), 50)
    root = watched_root(repository)
    log.info(
        "watching repository",
        repository=str(repository),
        real_path=str(root),
        mode="poll" if poll_interval_s else "events",
        quiet_period_s=quiet_period_s,
    )
    async for changes in watchfiles.awatch(
        root,
        watch_filter=_relevant,
        step=quiet_ms,
        debounce=max(quiet_ms * 10, 10_000),
        force_polling=poll_interval_s is not None,
        poll_delay_ms=int((poll_interval_s or 1.0) * 1000),
        recursive=True,
        ignore_permission_denied=True,
    ):
        sample = sorted({m for _, p in changes if (m := model_of(root, p)) is not None})
        log.debug("repository changed", models=sample[:10])
        wake("repository changed")
