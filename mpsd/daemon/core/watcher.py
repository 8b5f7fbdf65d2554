"""Watching the model repository: inotify on Linux, FSEvents on macOS (through watchfiles), or polling.

Events only wake the reconciler, after a quiet period with no further changes, so a directory being copied
is looked at once the copy has gone quiet.
"""

from __future__ import annotations

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


async def watch_repository(
    repository: Path, wake: Callable[[str], None], quiet_period_s: float, poll_interval_s: float | None
) -> None:
    """Run until cancelled; `poll_interval_s` set means polling instead of native events."""
    quiet_ms = max(int(quiet_period_s * 1000), 50)
    log.info(
        "watching repository",
        repository=str(repository),
        mode="poll" if poll_interval_s else "events",
        quiet_period_s=quiet_period_s,
    )
    async for changes in watchfiles.awatch(
        repository,
        watch_filter=_relevant,
        step=quiet_ms,
        debounce=max(quiet_ms * 10, 10_000),
        force_polling=poll_interval_s is not None,
        poll_delay_ms=int((poll_interval_s or 1.0) * 1000),
        recursive=True,
        ignore_permission_denied=True,
    ):
        sample = sorted(
            {Path(p).relative_to(repository).parts[0] for _, p in changes if p != str(repository)}
        )
        log.debug("repository changed", models=sample[:10])
        wake("repository changed")
