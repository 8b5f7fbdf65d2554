"""Supervision of one model instance: keep one worker alive, restart it with capped exponential back-off,
replace it when it outgrows its memory ceiling, and hand its ready channel to the instance's lane.

The instance schedules nothing: its lane (`dataplane.lane`) decides which batches go to the channel it is
given. Workers come from a factory, so supervision is tested on fake handles.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import structlog

from mpsd.daemon.dataplane.lane import Lane, LaneChannel
from mpsd.daemon.supervise.restart import STABLE_AFTER_S, Backoff
from mpsd.daemon.supervise.worker.process import WorkerLaunch
from mpsd.errors import LoadError
from mpsd.net.tasks import TaskGroup

log = structlog.get_logger("mpsd.daemon.supervisor")


class WorkerHandle(Protocol):
    """What supervision needs of a worker (`WorkerProcess`)."""

    @property
    def pid(self) -> int | None: ...

    @property
    def died(self) -> asyncio.Event: ...

    @property
    def over_ceiling(self) -> asyncio.Event: ...

    @property
    def exit_description(self) -> str: ...

    @property
    def ceiling_reason(self) -> str: ...

    @property
    def channel(self) -> LaneChannel:
        """Where its executions go, handed to the lane while the worker is ready."""
        ...

    async def start(self, timeout_s: float) -> object:
        """Ready to serve, or LoadError."""
        ...

    async def stop(self, timeout_s: float) -> None: ...

    async def kill(self) -> None: ...


H = TypeVar("H", bound=WorkerHandle)


@dataclass(frozen=True)
class SupervisorSettings:
    start_timeout_s: float = 300.0
    stop_timeout_s: float = 5.0
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    drain_timeout_s: float = 30.0
    request_timeout_s: float = 0.0
    heartbeat_timeout_s: float = 10.0


class Instance(Generic[H]):
    """`lane` takes the work of this instance's worker while the worker is ready."""

    def __init__(
        self,
        launch: WorkerLaunch,
        settings: SupervisorSettings,
        new_worker: Callable[[WorkerLaunch], H],
        lane: Lane[Any, Any],
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.launch = launch
        self.settings = settings
        self.lane = lane
        self.worker: H | None = None
        self.state = "starting"
        self.restarts = 0
        self.recycles = 0
        self.last_exit: str | None = None
        self.last_error: str | None = None
        self.started_at = 0.0
        self._new_worker = new_worker
        self._sleep = sleep
        self._clock = clock
        self._backoff = Backoff(settings.backoff_initial_s, settings.backoff_max_s, STABLE_AFTER_S)
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._retiring = TaskGroup()  # workers replaced (over their memory ceiling) being stopped

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    async def start(self) -> None:
        """First start: a load failure is the model's load failure (raised, not retried)."""
        self.worker = await self._spawn()
        self.state = "ready"
        self.lane.attach(self.worker.channel)
        self._task = asyncio.create_task(self._supervise(), name=f"instance {self.launch.label}")

    async def _spawn(self) -> H:
        worker = self._new_worker(self.launch)
        try:
            await worker.start(self.settings.start_timeout_s)
        except BaseException:
            await worker.kill()
            raise
        self.started_at = self._clock()
        self._backoff.started(self.started_at)
        return worker

    async def _supervise(self) -> None:
        while not self._stopping:
            worker = self.worker
            assert worker is not None
            done_with = asyncio.Event()
            dispatch = asyncio.create_task(self.lane.dispatch(worker.channel, done_with))
            died = asyncio.create_task(worker.died.wait())
            over = asyncio.create_task(worker.over_ceiling.wait())
            try:
                finished, _ = await asyncio.wait({dispatch, died, over}, return_when=asyncio.FIRST_COMPLETED)
                if over in finished and not worker.died.is_set() and not self._stopping:
                    replacement = await self._replacement(worker)
                    if replacement is not None:
                        await self.lane.hand_over(dispatch, done_with, replacement.channel)
                        self.worker = replacement
                        self._retiring.spawn(worker.stop(self.settings.stop_timeout_s))
                        continue
                    # No replacement: the old worker keeps taking batches until it ends.
                    await asyncio.wait({dispatch, died}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (dispatch, died, over):
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task
            if self._stopping and not worker.died.is_set():
                return
            await worker.died.wait()
            self.state = "restarting"
            self.last_exit = worker.exit_description
            self.lane.detach(f"worker restarting after {self.last_exit}")
            self._backoff.ended(self._clock())
            while not self._stopping:
                delay = self._backoff.delay()
                log.warning(
                    "restarting worker",
                    worker=self.launch.label,
                    after=self.last_exit,
                    delay_s=round(delay, 2),
                    restarts=self.restarts,
                )
                await self._sleep(delay)
                if self._stopping:
                    return
                try:
                    self.worker = await self._spawn()
                except LoadError as exc:
                    self.last_error = str(exc)
                    self.lane.down_reason = (
                        f"worker restarting after {self.last_exit}; last restart failed: {exc}"
                    )
                    log.error("worker restart failed", worker=self.launch.label, reason=str(exc))
                    continue
                self.restarts += 1
                self.last_error = None
                self.state = "ready"
                self.lane.attach(self.worker.channel)
                log.info("worker ready again", worker=self.launch.label, pid=self.worker.pid)
                break

    async def _replacement(self, worker: H) -> H | None:
        """Start and warm up a new worker while the old one keeps serving."""
        log.warning(
            "worker over its memory ceiling: starting a replacement",
            worker=self.launch.label,
            pid=worker.pid,
            reason=worker.ceiling_reason,
        )
        try:
            replacement = await self._spawn()
        except LoadError as exc:
            log.error(
                "replacement failed; the old worker keeps serving", worker=self.launch.label, reason=str(exc)
            )
            return None
        self.recycles += 1
        log.info("worker replaced", worker=self.launch.label, old_pid=worker.pid, new_pid=replacement.pid)
        return replacement

    async def stop(self, grace_s: float = 0.0) -> None:
        """Stop taking requests; with a grace period, let the request in progress finish first."""
        self._stopping = True
        self.state = "stopped"
        await self.lane.stop(grace_s)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.worker is not None:
            await self.worker.stop(self.settings.stop_timeout_s)
        # With the worker gone its executions end (their requests answered with the reason); what is left
        # of them, and of workers being retired, ends with the instance.
        await self.lane.close(self.settings.stop_timeout_s)
        await self._retiring.close(self.settings.stop_timeout_s)
