"""One instance's lane: which batches go to its worker's channel, and when.

Supervision attaches the channel of a worker that is ready, detaches it when the worker is lost, and hands
a replacement over; the lane decides the rest. A request that finds the lane idle runs in its caller's task
(`run_direct`); otherwise the lane's dispatcher takes the next batch from the version's queue whenever the
lane has room for it (`depth`). The lane knows its channel only as something that may refuse work, so its
scheduling is tested on fakes.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, Generic, Protocol, TypeVar

from mpsd.ipc.protocol import SEATS
from mpsd.net import eventloop
from mpsd.net.tasks import TaskGroup


class LaneChannel(Protocol):
    """A worker's channel as the lane sees it: set `refusing` once the worker stops or is gone; `overlaps`
    when its worker launches an execution behind the one running on the device (CUDA)."""

    @property
    def refusing(self) -> bool: ...

    @property
    def overlaps(self) -> bool: ...


# Where a worker overlaps executions, the next batch goes once the running execution has been at the head
# for this share of the typical time an execution holds it: early enough for the next one's inputs to be
# sent and copied to the device before the running one ends, late enough for the requests on their way
# back from the last execution to join it.
NEXT_AT = 0.2
# The weight of the latest execution in that typical time.
TYPICAL_WEIGHT = 0.2


B = TypeVar("B")
C = TypeVar("C", bound=LaneChannel)


class Batches(Protocol[B]):
    """The version's queue, as a lane pulls from it."""

    async def next_batch(self, partial: Callable[[], bool] | None = None) -> B: ...

    def __len__(self) -> int:
        """Requests queued now."""
        ...

    @property
    def last_batch_full(self) -> bool:
        """The last batch formed (`next_batch`, `gather`) reached the target size."""
        ...

    def wake(self) -> None:
        """An execution of the lane ended: `partial` may answer otherwise now."""
        ...

    def requeue(self, batch: B) -> None:
        """Give a batch back, in front: its lane lost its worker before running it."""
        ...

    async def gather(self, batch: B) -> B:
        """`batch`, which skipped the queue, with what may join it before it runs."""
        ...


class Lane(Generic[B, C]):
    """`execute(batch, channel)` runs a batch and answers its requests, whatever happens; `lanes()` are the
    version's lanes now (this one among them); `down()` is called whenever the lane loses its channel."""

    def __init__(
        self,
        batches: Batches[B],
        execute: Callable[[B, C], Awaitable[None]],
        lanes: Callable[[], Sequence[Lane[B, C]]],
        down: Callable[[], None],
    ) -> None:
        self.channel: C | None = None  # the ready worker's, while there is one
        self.down_reason = ""  # why there is none, for the version's refusal
        self._batches = batches
        self._execute_batch = execute
        self._lanes = lanes
        self._down = down
        self._stopping = False
        self._handing_over = False
        self._idle = asyncio.Event()  # set while no execution of this lane runs
        self._idle.set()
        self._running = TaskGroup()  # executions the dispatcher started
        self._dispatched = 0  # of them, those not ended (counted here: `_busy` runs for every request)
        self._direct = 0  # executions run by their caller's task (`run_direct`)
        self._freed = asyncio.Event()  # an execution ended: the dispatcher may take the next batch
        self._head_since: float | None = None  # when the oldest execution in flight became the oldest
        self._typical_s: float | None = None  # how long an execution is the oldest in flight, smoothed
        self._next_wake: asyncio.TimerHandle | None = None  # wakes the queue when the next batch may go
        self._next_wake_at: float | None = None
        self._clock = time.monotonic
        self._tell_backlog = eventloop.backlog_reporter()

    @property
    def serving(self) -> bool:
        return self.channel is not None and not self._stopping

    def attach(self, channel: C) -> None:
        """A worker is ready: its channel takes this lane's work."""
        self.channel = channel
        self.down_reason = ""

    def detach(self, reason: str) -> None:
        """The worker is lost (`reason` says how): no batch goes to its channel any more."""
        self.channel = None
        self.down_reason = reason
        self._down()

    def _depth(self) -> int:
        """Executions this lane keeps in flight. With one lane the next batch waits in the worker while the
        current one runs, so the worker never idles between them; with several, each takes one at a time,
        so a batch always goes to an idle lane while there is one."""
        return SEATS if len(self._lanes()) == 1 else 1

    def _busy(self) -> int:
        return self._dispatched + self._direct

    @property
    def full(self) -> bool:
        """No room for another execution: what arrives now waits for an answer of the lane's worker."""
        return self._busy() >= self._depth()

    @property
    def backlogged(self) -> bool:
        """Every lane of the version is full and its batches leave full: a request that arrives now waits
        for a worker's answer, which wakes the loop at once, and joins a batch that fills without it, so
        the loop may gather before it sleeps (`net/gather.py`). Where batches leave short, what arrives
        would fill them: gathering there cost 5% of the images/s at 64 clients on the H200."""
        lanes = self._lanes()
        return self._batches.last_batch_full and bool(lanes) and all(lane.full for lane in lanes)

    @property
    def eases_at(self) -> float:
        """When the first of the version's lanes is expected to answer: its oldest execution's typical end
        (inf while none of the lanes that run one knows its typical time yet)."""
        return min((lane._answer_due() for lane in self._lanes()), default=math.inf)

    def _answer_due(self) -> float:
        since, typical = self._head_since, self._typical_s
        return math.inf if since is None or typical is None else since + typical

    async def dispatch(self, channel: C, done_with: asyncio.Event) -> None:
        """Feed `channel` batches from the queue until it refuses, the lane stops, or `done_with` is set."""
        queue = self._batches
        while not self._stopping and not done_with.is_set():
            if self.full:
                self._freed.clear()
                await self._freed.wait()
                continue
            # The second execution in flight waits in the worker anyway: short of full it goes once the
            # first has ended (`_ended` wakes the queue) or, where the worker overlaps executions, once the
            # first nears its typical end (`_next_may_go`).
            batch = await queue.next_batch(self._next_may_go(channel) if self._depth() > 1 else None)
            if channel.refusing or self._stopping or done_with.is_set():
                queue.requeue(batch)
                return
            if self.full:  # direct executions took the room while it waited
                queue.requeue(batch)
                continue
            self._started()
            self._dispatched += 1
            self._told_if_full()
            self._running.spawn(self._execute(batch, channel)).add_done_callback(self._finished)

    def direct_channel(self) -> C | None:
        """The channel, when this lane is idle and can start an execution right now (attached, not handing
        over); None otherwise. A request that arrives while an execution runs queues instead, and the
        dispatcher forms the next batch: requests gather there rather than each taking a small execution."""
        channel = self.channel
        if channel is None or self._stopping or self._handing_over or channel.refusing or self._busy() > 0:
            return None
        return channel

    def run_direct(self, batch: B, channel: C, gather: bool = True) -> Coroutine[Any, Any, None]:
        """Run `batch` on `channel` in the caller's task, counted as this lane's execution: a request that
        finds its lane free skips the queue, the dispatcher's wake-up and a task of its own. With `gather`,
        requests that arrive while the queue gathers join it (`Batches.gather`). `execute` answers its
        requests; a cancelled caller leaves the execution to its channel, which skips it in the worker if it
        has not started.

        The lane counts the execution from this call, not from the coroutine's first step: a submitted
        request's runs in a task that starts later, and a request that arrives in between must not find
        the lane idle and start ahead of it (a full batch then overtook a short one gathering)."""
        self._started()
        self._direct += 1
        self._told_if_full()
        return self._direct_run(batch, channel, gather)

    async def _direct_run(self, batch: B, channel: C, gather: bool) -> None:
        try:
            if gather:
                batch = await self._batches.gather(batch)
            await self._execute(batch, channel)
        finally:
            self._direct -= 1
            self._ended()

    async def hand_over(self, dispatch: asyncio.Task[None], done_with: asyncio.Event, to: C) -> None:
        """Let the old channel finish the batch it is running, then feed `to` instead."""
        done_with.set()
        self._handing_over = True  # no direct execution starts on the old channel either
        try:
            if not self._idle.is_set():
                await self._idle.wait()
            dispatch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await dispatch
        finally:
            self._handing_over = False
        self.attach(to)

    async def _execute(self, batch: B, channel: C) -> None:
        with contextlib.suppress(Exception):  # `execute` answered every request; a death reaches supervision
            await self._execute_batch(batch, channel)

    def _finished(self, _task: asyncio.Task[None]) -> None:
        self._dispatched -= 1
        self._ended()

    def _next_may_go(self, channel: C) -> Callable[[], bool]:
        """Whether a batch short of full may go now as the next execution: once nothing runs, or, where the
        worker overlaps executions, once the running one nears its typical end (a timer wakes the queue
        then)."""

        def may_go() -> bool:
            if not self._busy():
                return True
            since, typical = self._head_since, self._typical_s
            if not channel.overlaps or since is None or typical is None:
                return False
            at = since + NEXT_AT * typical
            wait_s = at - self._clock()
            if wait_s <= 0:
                return True
            if self._next_wake_at != at:  # one timer for this moment, however often the queue looks
                if self._next_wake is not None:
                    self._next_wake.cancel()
                self._next_wake = asyncio.get_running_loop().call_later(wait_s, self._batches.wake)
                self._next_wake_at = at
            return False

        return may_go

    def _started(self) -> None:
        if not self._busy():
            self._head_since = self._clock()
        self._idle.clear()

    def _told_if_full(self) -> None:
        if self.full:
            self._tell_backlog(self)

    def _ended(self) -> None:
        now = self._clock()
        if self._head_since is not None:  # executions end in the order they started: the oldest ended
            held = now - self._head_since
            typical = self._typical_s
            self._typical_s = held if typical is None else typical + TYPICAL_WEIGHT * (held - typical)
        self._head_since = now if self._busy() else None
        self._freed.set()
        if len(self._batches):  # a dispatcher holding a short batch may send it now; an empty queue has none
            self._batches.wake()
        if not self._busy():
            self._idle.set()

    async def stop(self, grace_s: float = 0.0) -> None:
        """Take no more work; with a grace period, let the execution in progress finish first."""
        self._stopping = True
        if grace_s > 0 and not self._idle.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), grace_s)

    async def close(self, timeout_s: float) -> None:
        """The worker is gone, so its executions end (their requests answered with the reason): what is
        left of them ends with the lane."""
        self.channel = None
        await self._running.close(timeout_s)
