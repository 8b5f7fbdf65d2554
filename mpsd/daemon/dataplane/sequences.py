"""Sequence batching: which instance slot holds each live sequence, and which of its requests run when.

A sequence (a correlation ID from its START to its END) holds one slot of one instance (a lane) for its
whole life, and its requests run one at a time, in arrival order. An instance has `max_batch_size` slots
(1 without batching) with the direct strategy, `max_candidate_sequences` with the oldest; an execution takes
the next request of each of the lane's sequences that has one ready, up to `max_batch_size` rows (direct: in
slot order; oldest: oldest first, waiting up to `max_queue_delay_microseconds` for its preferred size). A
sequence that starts while every slot is taken waits in a backlog for one (as Triton's does); one that
waits past `max_sequence_idle_microseconds` for its next request is ended and its slot freed. A lane whose
worker is lost or replaced loses its sequences (their state was in that worker): their queued requests fail,
and so do later ones until the ID starts again.

Each lane pulls its batches from its own `LaneSlots` (the lane's `Batches`), so the lane's scheduling is
the plain one (`lane.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import structlog

from mpsd.config.model_config import ModelConfig
from mpsd.daemon.dataplane.queue import Pending
from mpsd.daemon.dataplane.request import InferRequest, SequenceStep
from mpsd.daemon.dataplane.sequence_controls import Controls
from mpsd.errors import DeadlineExceeded, InvalidArgument, MpsdError, Unavailable

log = structlog.get_logger("mpsd.daemon.sequences")

LOST_REMEMBERED = 4096  # IDs of lost sequences kept for their clear error, oldest forgotten first


@dataclass(eq=False)
class Sequence:
    """One live sequence: its slot (`lanes` None in the backlog), requests waiting, and the one running."""

    corrid: int | str
    lanes: LaneSlots | None = None
    slot: int = -1
    queue: deque[Pending] = field(default_factory=deque)
    running: Pending | None = None
    last: float = 0.0  # time.monotonic() of its latest request's arrival or end


@dataclass
class SequenceCounts:
    """Sequences started, ended (by their END), timed out (idle too long) and lost (their worker went)."""

    started: int = 0
    ended: int = 0
    timed_out: int = 0
    lost: int = 0


class SequenceScheduler:
    """The sequences of one model version. `clock` is time.monotonic (tests drive it)."""

    def __init__(
        self, name: str, version: int, config: ModelConfig, clock: Callable[[], float] = time.monotonic
    ):
        sb = config.sequence_batching
        assert sb is not None
        self.name = name
        self.version = version
        self.label = f"'{name}' version {version}"
        self.controls = Controls(config)
        self.rows = max(config.max_batch_size, 1)
        self.oldest = sb.oldest is not None
        strategy = sb.oldest if sb.oldest is not None else sb.direct
        self.delay_s = strategy.max_queue_delay_microseconds / 1e6 if strategy is not None else 0.0
        preferred = sb.oldest.preferred_batch_size if sb.oldest is not None else []
        self.target = min(max(preferred), self.rows) if preferred else self.rows
        self.slots_per_lane = sb.oldest.max_candidate_sequences if sb.oldest is not None else self.rows
        self.idle_s = sb.idle_s
        self.clock = clock
        self.live: dict[int | str, Sequence] = {}  # by ID, from its START until its END arrives
        self.backlog: deque[Sequence] = deque()
        self.lanes: list[LaneSlots] = []
        self.lost: OrderedDict[int | str, str] = OrderedDict()
        self.counts = SequenceCounts()
        self._holding: dict[int, Sequence] = {}  # id(Pending) -> its sequence, while it runs
        self._originals: dict[int, InferRequest] = {}  # id(Pending) -> its request without controls
        self._timer: asyncio.TimerHandle | None = None
        self.freed = asyncio.Event()  # set whenever a sequence leaves its slot (`SequencePlane.drained`)

    # ---- arrivals ----------------------------------------------------------------------------------

    @property
    def active(self) -> int:
        """Sequences that hold a slot or wait for one."""
        return sum(len(lanes.held()) for lanes in self.lanes) + len(self.backlog)

    def new_lane(self) -> LaneSlots:
        lanes = LaneSlots(self)
        self.lanes.append(lanes)
        return lanes

    def holds(self, request: InferRequest) -> bool:
        """Whether `request` continues a sequence that is live here (a version closed for new sequences
        still takes these)."""
        step = request.sequence
        return step is not None and not step.start and step.corrid in self.live

    def put(self, item: Pending) -> None:
        """Route a request to its sequence (starting one for a START), or refuse it as Triton does."""
        step = item.request.sequence
        if step is None:  # a call from another model or an ensemble's step: it carries no sequence
            raise InvalidArgument(
                f"inference request to model '{self.name}' must specify a non-zero or non-empty correlation "
                "ID"
            )
        self.controls.check(self.name, step)
        seq = self.live.get(step.corrid)
        if seq is None:
            if not step.start:
                raise self._unknown(step.corrid)
            seq = self._begin(step.corrid)
        elif step.start:
            log.warning(
                "sequence started again before its end: it continues in its slot from this start",
                model=self.name,
                version=self.version,
                sequence=str(step.corrid),
            )
        seq.queue.append(item)
        seq.last = self.clock()
        if step.end:
            del self.live[step.corrid]
        if seq.lanes is not None:
            seq.lanes.arrived.set()
        self._arm()

    def _unknown(self, corrid: int | str) -> MpsdError:
        why = self.lost.get(corrid)
        if why is not None:
            return Unavailable(
                f"inference request for sequence {corrid!s} to model '{self.name}': the sequence "
                f"was lost ({why}) with its state; start it again with the START flag"
            )
        return InvalidArgument(
            f"inference request for sequence {corrid!s} to model '{self.name}' must specify the "
            "START flag on the first request of the sequence"
        )

    def _begin(self, corrid: int | str) -> Sequence:
        self.lost.pop(corrid, None)
        seq = Sequence(corrid)
        self.live[corrid] = seq
        self.counts.started += 1
        free = [
            (lanes.load(), i, lanes) for i, lanes in enumerate(self.lanes) if lanes.serving and lanes.free()
        ]
        if free:
            free.sort(key=lambda entry: entry[:2])
            free[0][2].seat(seq)
        else:
            self.backlog.append(seq)
        return seq

    # ---- batches -----------------------------------------------------------------------------------

    def take(self, seq: Sequence) -> Pending:
        """The sequence's next request, marked running, with its control inputs; an END frees the slot."""
        item = seq.queue.popleft()
        seq.running = item
        step = item.request.sequence
        assert step is not None and seq.lanes is not None
        self._holding[id(item)] = seq
        self._originals[id(item)] = item.request
        item.request = self.controls.add(
            item.request, SequenceStep(step.corrid, step.start, step.end, seq.slot)
        )
        item.future.add_done_callback(functools.partial(self._finished, item))
        if step.end and not seq.queue:
            self.counts.ended += 1
            self._release(seq)
        return item

    def _finished(self, item: Pending, _future: object = None) -> None:
        seq = self._holding.pop(id(item), None)
        self._originals.pop(id(item), None)
        if seq is None:
            return
        if seq.running is item:
            seq.running = None
        seq.last = self.clock()
        if seq.lanes is not None:
            seq.lanes.arrived.set()

    def give_back(self, items: Iterable[Pending], why: str) -> None:
        """Requests taken for a lane whose worker went away before running them: their sequences are lost
        (their state was in that worker), the requests fail."""
        for item in items:
            seq = self._holding.get(id(item))
            original = self._originals.get(id(item))
            if original is not None:
                item.request = original
            if seq is not None:
                self._lose(seq, why)
            if not item.future.done():
                item.future.set_exception(self._lost_error(item, why))

    def _lost_error(self, item: Pending, why: str) -> MpsdError:
        step = item.request.sequence
        corrid = str(step.corrid) if step is not None else "?"
        return Unavailable(
            f"inference request for sequence {corrid} to model '{self.name}': the sequence was lost ({why}) "
            "with its state; start it again with the START flag"
        )

    def _release(self, seq: Sequence) -> None:
        """Free the sequence's slot, for the backlog's first sequence if one waits."""
        lanes = seq.lanes
        if lanes is None:
            return
        lanes.slots[seq.slot] = None
        seq.lanes = None
        self.freed.set()
        if self.backlog and lanes.serving:
            lanes.seat(self.backlog.popleft())

    def _lose(self, seq: Sequence, why: str) -> None:
        """The sequence's state is gone: its queued requests fail and its ID is remembered as lost."""
        if seq.lanes is None and seq not in self.backlog:
            return  # lost already
        self.counts.lost += 1
        self._release(seq)
        if self.live.get(seq.corrid) is seq:
            del self.live[seq.corrid]
        self.lost[seq.corrid] = why
        while len(self.lost) > LOST_REMEMBERED:
            self.lost.popitem(last=False)
        while seq.queue:
            item = seq.queue.popleft()
            if not item.future.done():
                item.future.set_exception(self._lost_error(item, why))

    def lane_lost(self, lanes: LaneSlots, why: str) -> None:
        """The lane's worker is gone or replaced: every sequence it holds is lost."""
        for seq in lanes.held():
            self._lose(seq, why)
        if self.backlog:  # the freed slots are not the lane's to give while it has no worker
            for other in self.lanes:
                while other.serving and other.free() and self.backlog:
                    other.seat(self.backlog.popleft())

    def lane_serving(self, lanes: LaneSlots) -> None:
        """A worker is ready on the lane: sequences in the backlog may take its slots."""
        while self.backlog and lanes.free():
            lanes.seat(self.backlog.popleft())

    def fail_all(self, error: MpsdError) -> None:
        """The version closes: every queued request fails, every sequence ends."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for seq in [s for lanes in self.lanes for s in lanes.held()] + list(self.backlog):
            self._release(seq)
            while seq.queue:
                item = seq.queue.popleft()
                if not item.future.done():
                    item.future.set_exception(error)
        self.backlog.clear()
        self.live.clear()

    # ---- idle sequences ------------------------------------------------------------------------------

    def _arm(self) -> None:
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.idle_s, self._reap)

    def _reap(self) -> None:
        """End the sequences that waited past the idle timeout for their next request (Triton frees the
        slot and tells the model nothing; the next START in that slot resets its state)."""
        self._timer = None
        now = self.clock()
        soonest: float | None = None
        for lanes in self.lanes:
            for seq in lanes.held():
                if seq.running is not None or seq.queue:
                    continue
                due = seq.last + self.idle_s
                if now >= due:
                    log.info(
                        "sequence timed out",
                        model=self.name,
                        version=self.version,
                        sequence=str(seq.corrid),
                        idle_s=round(now - seq.last, 3),
                    )
                    self.counts.timed_out += 1
                    if self.live.get(seq.corrid) is seq:
                        del self.live[seq.corrid]
                    self._release(seq)
                else:
                    soonest = due if soonest is None else min(soonest, due)
        held = any(lanes.held() for lanes in self.lanes)
        if held:
            delay = self.idle_s if soonest is None else max(0.001, soonest - now)
            self._timer = asyncio.get_running_loop().call_later(delay, self._reap)


class LaneSlots:
    """One lane's slots and its batches (the lane's `Batches`), which never let its loop gather."""

    last_batch_full = False

    def __init__(self, scheduler: SequenceScheduler) -> None:
        self.scheduler = scheduler
        self.slots: list[Sequence | None] = [None] * scheduler.slots_per_lane
        self.arrived = asyncio.Event()
        self.serving = False

    def held(self) -> list[Sequence]:
        return [seq for seq in self.slots if seq is not None]

    def load(self) -> int:
        return len(self.held())

    def free(self) -> bool:
        return None in self.slots

    def seat(self, seq: Sequence) -> None:
        slot = self.slots.index(None)
        self.slots[slot] = seq
        seq.lanes, seq.slot = self, slot
        self.arrived.set()

    def _ready(self) -> list[Sequence]:
        """Sequences with a request ready to run (none of theirs running), their dead requests dropped."""
        ready = []
        for seq in self.slots:
            if seq is None or seq.running is not None:
                continue
            queue = seq.queue
            while queue and queue[0].future.done():
                dropped = queue.popleft()
                step = dropped.request.sequence
                if step is not None and step.end and not queue:  # its end will not come
                    self.scheduler.counts.ended += 1
                    self.scheduler._release(seq)
            if queue and seq.lanes is self:
                head = queue[0]
                if head.deadline is not None and self.scheduler.clock() >= head.deadline:
                    queue.popleft()
                    head.future.set_exception(
                        DeadlineExceeded(f"model {self.scheduler.label}: request waited past its deadline")
                    )
                    continue
                ready.append(seq)
        if self.scheduler.oldest:
            ready.sort(key=lambda s: s.queue[0].enqueued_ns)
        return ready

    async def next_batch(self, partial: Callable[[], bool] | None = None) -> list[Pending]:
        """The next requests of the lane's ready sequences, one each, up to max_batch_size rows."""
        sched = self.scheduler
        while True:
            ready = self._ready()
            if not ready:
                await self._wait(None)
                continue
            # oldest: short of the preferred size, as dynamic batching; direct: some sequence has none ready
            short = len(ready) < (sched.target if sched.oldest else min(sched.rows, len(self.held())))
            if short and sched.delay_s > 0:
                waited = (time.perf_counter_ns() - ready[0].queue[0].enqueued_ns) / 1e9
                if waited < sched.delay_s:
                    await self._wait(sched.delay_s - waited)
                    continue
            if short and partial is not None and not partial():
                await self._wait(None)
                continue
            return [sched.take(seq) for seq in ready[: sched.rows]]

    async def _wait(self, timeout: float | None) -> None:
        self.arrived.clear()
        if timeout is None:
            await self.arrived.wait()
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.arrived.wait(), timeout)

    def __len__(self) -> int:  # requests queued in the lane's sequences: what a wake may find ready
        return sum(len(seq.queue) for seq in self.slots if seq is not None)

    def wake(self) -> None:
        self.arrived.set()

    def requeue(self, batch: list[Pending]) -> None:
        self.scheduler.give_back(batch, "its instance's worker went away before running it")

    async def gather(self, batch: list[Pending]) -> list[Pending]:
        return batch  # a sequence's request never skips its scheduling
