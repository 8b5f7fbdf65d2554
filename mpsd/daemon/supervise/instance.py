"""Supervision of one model instance: keep one worker alive, restart it with capped exponential back-off,
and feed it batches from its version's queue.

The instance knows its version only through what it is handed: a source of batches, what runs a batch on a
worker, what to call when the instance goes down, and how many instances the version has. Workers come
from a factory, so supervision is tested on fake handles.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import structlog

from mpsd.daemon.supervise.restart import STABLE_AFTER_S, Backoff
from mpsd.daemon.supervise.worker.process import WorkerLaunch
from mpsd.errors import LoadError
from mpsd.ipc.protocol import SLOTS
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

    async def start(self, timeout_s: float) -> object:
        """Ready to serve, or LoadError."""
        ...

    async def stop(self, timeout_s: float) -> None: ...

    async def kill(self) -> None: ...


B = TypeVar("B")
H = TypeVar("H", bound=WorkerHandle)


class Batches(Protocol[B]):
    """The version's queue, as an instance pulls from it."""

    async def next_batch(self, partial: Callable[[], bool] | None = None) -> B: ...

    def wake(self) -> None:
        """An execution of the instance ended: `partial` may answer otherwise now."""
        ...

    def requeue(self, batch: B) -> None:
        """Give a batch back, in front: its instance went away before running it."""
        ...

    async def gather(self, batch: B) -> B:
        """`batch`, which skipped the queue, with what may join it before it runs."""
        ...


@dataclass(frozen=True)
class SupervisorSettings:
    start_timeout_s: float = 300.0
    stop_timeout_s: float = 5.0
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    drain_timeout_s: float = 30.0
    request_timeout_s: float = 0.0
    heartbeat_timeout_s: float = 10.0


class Instance(Generic[B, H]):
    """`execute(batch, worker)` runs a batch and answers its requests, whatever happens; `instance_down()` is
    called whenever the worker is lost; `instance_count()` is how many instances the version has now."""

    def __init__(
        self,
        launch: WorkerLaunch,
        settings: SupervisorSettings,
        new_worker: Callable[[WorkerLaunch], H],
        batches: Batches[B],
        execute: Callable[[B, H], Awaitable[None]],
        instance_down: Callable[[], None],
        instance_count: Callable[[], int],
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.launch = launch
        self.settings = settings
        self.worker: H | None = None
        self.state = "starting"
        self.restarts = 0
        self.recycles = 0
        self.last_exit: str | None = None
        self.last_error: str | None = None
        self.started_at = 0.0
        self._new_worker = new_worker
        self._batches = batches
        self._execute_batch = execute
        self._instance_down = instance_down
        self._instance_count = instance_count
        self._sleep = sleep
        self._clock = clock
        self._backoff = Backoff(settings.backoff_initial_s, settings.backoff_max_s, STABLE_AFTER_S)
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._idle = asyncio.Event()  # set while no execution of this instance runs
        self._idle.set()
        self._running = TaskGroup()  # executions the dispatcher started
        self._direct = 0  # executions run by their caller's task (`run_direct`)
        self._freed = asyncio.Event()  # an execution ended: the dispatcher may take the next batch
        self._handing_over = False
        self._retiring = TaskGroup()  # workers replaced (over their memory ceiling) being stopped

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    async def start(self) -> None:
        """First start: a load failure is the model's load failure (raised, not retried)."""
        self.worker = await self._spawn()
        self.state = "ready"
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
            dispatch = asyncio.create_task(self._dispatch(worker, done_with))
            died = asyncio.create_task(worker.died.wait())
            over = asyncio.create_task(worker.over_ceiling.wait())
            try:
                finished, _ = await asyncio.wait({dispatch, died, over}, return_when=asyncio.FIRST_COMPLETED)
                if over in finished and not worker.died.is_set() and not self._stopping:
                    replacement = await self._replacement(worker)
                    if replacement is not None:
                        await self._hand_over(dispatch, done_with)
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
            self._instance_down()
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
                    log.error("worker restart failed", worker=self.launch.label, reason=str(exc))
                    continue
                self.restarts += 1
                self.last_error = None
                self.state = "ready"
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

    async def _hand_over(self, dispatch: asyncio.Task[None], done_with: asyncio.Event) -> None:
        """Let the old worker finish the batch it is running, then stop feeding it."""
        done_with.set()
        self._handing_over = True  # no direct execution starts on the old worker either
        try:
            if not self._idle.is_set():
                await self._idle.wait()
            dispatch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await dispatch
        finally:
            self._handing_over = False

    def _depth(self) -> int:
        """Executions this instance keeps in flight. With one instance the next batch waits in the worker
        while the current one runs, so the worker never idles between them; with several, each takes one
        at a time, so a batch always goes to an idle instance while there is one."""
        return SLOTS if self._instance_count() == 1 else 1

    def _busy(self) -> int:
        return len(self._running) + self._direct

    async def _dispatch(self, worker: H, done_with: asyncio.Event) -> None:
        queue = self._batches
        while not self._stopping and not done_with.is_set():
            if self._busy() >= self._depth():
                self._freed.clear()
                await self._freed.wait()
                continue
            # The second execution in flight waits in the worker anyway: it goes only when full, or
            # once the first has ended (`_ended` wakes the queue).
            batch = await queue.next_batch(self._nothing_running if self._depth() > 1 else None)
            if worker.died.is_set() or self._stopping or done_with.is_set():
                queue.requeue(batch)
                return
            if self._busy() >= self._depth():  # direct executions took the room while it waited
                queue.requeue(batch)
                continue
            self._idle.clear()
            self._running.spawn(self._execute(batch, worker)).add_done_callback(self._finished)

    def direct_worker(self) -> H | None:
        """The worker, when this instance is idle and can start an execution right now (ready, not handing
        over); None otherwise. A request that arrives while an execution runs queues instead, and the
        dispatcher forms the next batch (`_dispatch`): requests gather there rather than each taking a
        small execution of its own."""
        worker = self.worker
        if (
            self.state != "ready"
            or self._stopping
            or self._handing_over
            or worker is None
            or worker.died.is_set()
            or self._busy() > 0
        ):
            return None
        return worker

    async def run_direct(self, batch: B, worker: H, gather: bool = True) -> None:
        """Run `batch` on `worker` in the caller's task, counted as this instance's execution: a request
        that finds its instance free skips the queue, the dispatcher's wake-up and a task of its own.
        With `gather`, requests that arrive while the queue gathers join it (`Batches.gather`). `execute`
        answers its requests; a cancelled caller leaves the execution to its channel, which skips it in
        the worker if it has not started."""
        self._direct += 1
        self._idle.clear()
        try:
            if gather:
                batch = await self._batches.gather(batch)
            await self._execute(batch, worker)
        finally:
            self._direct -= 1
            self._ended()

    async def _execute(self, batch: B, worker: H) -> None:
        with contextlib.suppress(Exception):  # `execute` answered every request; a death wakes `_supervise`
            await self._execute_batch(batch, worker)

    def _finished(self, _task: asyncio.Task[None]) -> None:
        self._ended()

    def _nothing_running(self) -> bool:
        return not self._busy()

    def _ended(self) -> None:
        self._freed.set()
        self._batches.wake()
        if not self._busy():
            self._idle.set()

    async def stop(self, grace_s: float = 0.0) -> None:
        """Stop taking requests; with a grace period, let the request in progress finish first."""
        self._stopping = True
        self.state = "stopped"
        if grace_s > 0 and not self._idle.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), grace_s)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.worker is not None:
            await self.worker.stop(self.settings.stop_timeout_s)
        # With the worker gone its executions end (their requests answered with the reason); what is left
        # of them, and of workers being retired, ends with the instance.
        await self._running.close(self.settings.stop_timeout_s)
        await self._retiring.close(self.settings.stop_timeout_s)
