"""One reconcile at a time: every trigger (file watcher, SIGHUP, admin RPC) only wakes this loop, and
triggers that arrive while a reconcile runs coalesce into one more run."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Collection

import structlog

from mpsd.daemon.core.registry import ReconcileReport, Registry

log = structlog.get_logger("mpsd.daemon.reconcile")


class Reconciler:
    def __init__(
        self,
        registry: Registry,
        before: Callable[[], None] = lambda: None,
        after: Callable[[ReconcileReport], Awaitable[None]] | None = None,
    ) -> None:
        self.registry = registry
        self._before = before
        self._after = after
        self._wake = asyncio.Event()
        self._retry: asyncio.TimerHandle | None = None

    def wake(self, reason: str = "") -> None:
        if reason:
            log.debug("reconcile requested", trigger=reason)
        self._wake.set()

    async def run_once(self, only: Collection[str] | None = None, wait_quiet: bool = True) -> ReconcileReport:
        """Run a reconcile now (after any one in progress: the registry serialises them) and report."""
        self._before()
        report = await self.registry.reconcile(only, wait_quiet=wait_quiet)
        if report.deferred:
            # Files still changing: look again once they have been quiet for the whole period.
            delay = max(self.registry.quiet_period_s, 0.1)
            if self._retry is not None:
                self._retry.cancel()
            self._retry = asyncio.get_running_loop().call_later(delay, self.wake, "deferred models")
        if self._after is not None:
            await self._after(report)
        return report

    async def run_forever(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self.run_once()
            except Exception:
                log.exception("reconcile failed")
