"""A model version's request queue: what waits, in which order, and until when.

Instances pull work when they are free, so a batch always goes to an idle instance; which queued requests
form the batch, and when it goes, is batch forming's (`batching.py`), whose methods `RequestQueue`
inherits.

Priority levels order the queue and each level's queue policy applies (size limit, timeout, REJECT or
DELAY: `priorities.py`); a model with one level and no DELAY has the plain first-in first-out queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable, Hashable, Iterable
from dataclasses import dataclass, field

from mpsd.config.model_config import ModelConfig
from mpsd.daemon.dataplane.alarms import Alarms
from mpsd.daemon.dataplane.batching import Alarmed, BatchForming, disarm
from mpsd.daemon.dataplane.priorities import Policy, Priorities, Sizes, place, queue_full, timeout_expired
from mpsd.daemon.dataplane.request import InferRequest, InferResult, Timings
from mpsd.daemon.dataplane.streaming import ResponseStream
from mpsd.errors import DeadlineExceeded, MpsdError
from mpsd.net import eventloop
from mpsd.net.settle import settled


class Told(asyncio.Future[InferResult]):
    """A submitted request's future (`VersionPlane.submit`): once done (answered, failed or cancelled) it
    tells its submitter at once, in the call that settled it, not through a callback the loop runs later:
    no handle and no pass of the loop per request. A failure in `tell` is the loop's to report, as a
    callback's would be; whoever settled the future goes on."""

    __slots__ = ("_tell", "rows", "start", "then")

    def __init__(
        self,
        tell: Callable[[Told], None],
        start: int,
        rows: int,
        then: Callable[[asyncio.Future[InferResult]], None] | None,
    ) -> None:
        super().__init__()
        self._tell: Callable[[Told], None] | None = tell
        # What `tell` needs, kept here rather than bound in a partial, one fewer object per request: when it
        # arrived (the arrival clock's ns), its rows, and what its submitter runs once it is settled.
        self.start = start
        self.rows = rows
        self.then = then

    def set_result(self, result: InferResult) -> None:
        super().set_result(result)
        self._told()

    def set_exception(self, exception: type | BaseException) -> None:
        super().set_exception(exception)
        self._told()

    def cancel(self, msg: object = None) -> bool:
        if not super().cancel(msg):
            return False
        self._told()
        return True

    def _told(self) -> None:
        # Let go of `tell` first, as a future lets go of its callbacks: the submitter often holds this
        # future, and the cycle would outlive the request until a collection.
        tell, self._tell = self._tell, None
        if tell is None:
            return
        try:
            tell(self)
        except Exception as exc:
            self.get_loop().call_exception_handler(
                {"message": "a submitted request's answer failed", "exception": exc, "future": self}
            )


@dataclass(slots=True)
class Pending:
    """A request waiting for, or being run by, an instance. Its future always ends: result or error. With
    slots: one is made for every request, half as long (0.53 against 1.0 us on the 2-core VM)."""

    request: InferRequest
    future: asyncio.Future[InferResult]
    enqueued_ns: int
    deadline: float | None = None  # time.monotonic() by which it must have started, or it is not run
    timings: Timings = field(default_factory=Timings)
    timer: Alarmed | None = None  # answers it at its deadline while it is queued (`alarms.py`)
    stream: ResponseStream | None = None  # a decoupled model's request: where its responses go
    level: int = 0  # its priority level (0: the model has none)
    reject_at: float | None = None  # its level's timeout under REJECT (then also its deadline, if earlier)
    delay_at: float | None = None  # its level's timeout under DELAY: it moves behind its level's others
    delayed: bool = False  # moved behind them
    shape_key: Hashable | None = None  # a bucketed model's key (dataplane/buckets.py): lengths as buckets
    _key: Hashable | None = field(default=None, repr=False, compare=False)  # `key`, once made

    @property
    def rank(self) -> int:
        """Where it belongs in the queue: a smaller rank is taken first (`priorities.py`)."""
        return self.level * 2 + self.delayed

    @property
    def key(self) -> Hashable:
        """Requests with equal keys can share a batch (made once: batches are formed again and again): the
        same datatypes and shapes past the batch dimension, and the same parameters for a model that reads
        them. Kept in a field, not a `functools.cached_property`, whose lock on Python 3.11 doubled the
        cost of the first read, made once for every request."""
        key = self._key
        if key is None:
            inputs = self.request.inputs
            if self.shape_key is not None:
                key = self.shape_key
            else:
                if len(inputs) == 1:  # most models: no loop over the inputs (0.4 against 1.2 us)
                    key = ((inputs[0].datatype, inputs[0].shape[1:]),)
                else:
                    key = tuple([(t.datatype, t.shape[1:]) for t in inputs])
                if self.request.parameters:
                    key = (key, self.request.parameters)
            self._key = key
        return key


class RequestQueue(BatchForming[Pending]):
    """`settle` waits until the requests already on their way have arrived (the loop's, by default).
    `clock` is the time deadlines are in, `clock_ns` the one requests are stamped with on arrival
    (`Pending.enqueued_ns`, by `arrival_clock`, which dates what a gathering loop held back from its wait's
    start): tests drive both from an event loop's virtual time."""

    def __init__(
        self,
        config: ModelConfig,
        label: str,
        settle: Callable[[], Awaitable[None]] = settled,
        clock: Callable[[], float] = time.monotonic,
        clock_ns: Callable[[], int] = time.perf_counter_ns,
    ) -> None:
        self.label = label
        self._clock = clock
        self._clock_ns = clock_ns
        self.arrival_clock = eventloop.arrival_clock(clock_ns)
        db = config.dynamic_batching
        self.batching = db is not None and config.max_batch_size > 0
        self.max_rows = config.max_batch_size if self.batching else 1
        preferred = db.preferred_batch_size if db is not None else []
        self.target_rows = min(max(preferred), self.max_rows) if preferred else self.max_rows
        self.delay_s = (db.max_queue_delay_microseconds / 1e6) if db is not None else 0.0
        self.priorities = levels = Priorities(db)
        self.max_size = levels.default.max_size
        self._ordered = levels.ordered  # requests placed by rank, not appended
        self._delays = levels.delays  # a DELAY policy may move a request back
        self._timed = levels.timed  # some level has a timeout or lets a request set one
        default = levels.default
        plain = not (levels.several or default.delay or default.override)
        self._fixed_s = default.timeout_s if plain else 0.0  # every request's timeout, where one is
        self._sizes = Sizes(levels.counted)
        self._items: deque[Pending] = deque()
        self._rows = 0  # queued rows, of every shape
        # For each waiting `next_batch` (an instance's dispatcher), the queued rows at which it wants to
        # look again (a first request; a full batch): arrivals short of all of them wake nobody.
        self._waiting: list[int] = []
        self._arrived = asyncio.Event()
        self._settle = settle
        self._gathering = 0  # requests that skipped the queue and wait for others to join them
        self._alarms: Alarms[Pending] = Alarms(self._expire, clock)

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: Pending) -> None:
        """Enqueue, or refuse at once when its level's queue is full (backpressure, not unbounded memory)."""
        if self._ordered:
            self._put_ranked(item)
        else:
            if self.max_size and len(self._items) >= self.max_size:
                raise queue_full(item.request)
            self.admit(item)
            self._items.append(item)
        self._rows += item.request.batch_size
        self._arm(item)
        if self._waiting and self._rows >= min(self._waiting):
            self._arrived.set()

    def admit(self, item: Pending) -> None:
        """Apply the request's level's timeout (also to one that skips the queue)."""
        if not self._timed:
            return
        fixed = self._fixed_s
        if fixed:  # the one level's REJECT timeout, which no request overrides: as a plain deadline
            limit = self._clock() + fixed
            item.reject_at = limit
            item.deadline = limit if item.deadline is None else min(item.deadline, limit)
        else:
            self._time(item, self._policy(item))

    def _policy(self, item: Pending) -> Policy:
        levels = self.priorities
        if levels.several:
            item.level = levels.level(item.request)
        return levels.policy(item.level)

    def _time(self, item: Pending, policy: Policy) -> None:
        """Under REJECT the timeout is a deadline too, so it also bounds the wait in the worker behind the
        execution before it; under DELAY it is only the moment the request moves back."""
        timeout = policy.timeout(item.request)
        if not timeout:
            return
        at = self._clock() + timeout
        if policy.delay:
            item.delay_at = at
        else:
            item.reject_at = at
            item.deadline = at if item.deadline is None else min(item.deadline, at)

    def _put_ranked(self, item: Pending) -> None:
        policy = self._policy(item)
        if policy.max_size:
            queued = self._sizes.of(item.level) if self.priorities.several else len(self._items)
            if queued >= policy.max_size:
                raise queue_full(item.request)
        if self._timed:
            self._time(item, policy)
        place(self._items, item)
        self._sizes.add(item.level)

    def _move_back(self, item: Pending) -> None:
        """Its DELAY timeout expired: behind its level's requests that have not, and kept."""
        with contextlib.suppress(ValueError):  # taken meanwhile
            self._items.remove(item)
            self._delay(item)

    def _delay(self, item: Pending) -> None:
        disarm([item])
        item.delayed = True
        place(self._items, item)
        self._arm(item)  # for its deadline, if it has one

    def runs_at_once(self, item: Pending) -> bool:
        """Whether a free instance would take `item` the moment it arrived: nothing waits ahead of it and
        batching would not hold it for more rows. Such a request may go to that instance directly."""
        if self._items or self._gathering:
            return False
        return not (self.batching and self.delay_s > 0 and item.request.batch_size < self.target_rows)

    def requeue(self, items: Iterable[Pending]) -> None:
        """Put items back at the front (of their rank), in their order (their instance went away before
        running them)."""
        items = list(items)
        if self._ordered:
            self._items = deque(sorted([*items, *self._items], key=_rank))  # stable: ahead of their rank
            self._sizes.count(self._items)
        else:
            self._items.extendleft(reversed(items))
        for item in items:
            self._rows += item.request.batch_size
            self._arm(item)
        self._arrived.set()

    def take_all(self) -> list[Pending]:
        items = list(self._items)
        self._items.clear()
        self._sizes.count(())
        self._rows = 0
        disarm(items)
        return items

    def _arm(self, item: Pending) -> None:
        """Answer the item at its deadline if it is still queued then: while every instance is busy, nobody
        takes work from the queue, and the client would otherwise wait for an instance to free up. Under
        DELAY, move it back at its timeout, if that comes first."""
        at, moves = item.deadline, False
        if item.delay_at is not None and not item.delayed and (at is None or item.delay_at < at):
            at, moves = item.delay_at, True
        if at is not None:
            item.timer = self._alarms.set(at, item, moves)

    def _expire(self, item: Pending, moves: bool = False) -> None:
        item.timer = None
        if moves:
            self._move_back(item)
            return
        with contextlib.suppress(ValueError):  # taken meanwhile
            self._items.remove(item)
            self._rows -= item.request.batch_size
            self._sizes.remove(item)
            self._expired(item)

    def _expired(self, item: Pending) -> None:
        if item.future.done():
            return
        if item.reject_at is not None and item.deadline is not None and item.reject_at <= item.deadline:
            item.future.set_exception(timeout_expired())  # its level's timeout, not the client's deadline
            return
        waited_ms = (self._clock_ns() - item.enqueued_ns) / 1e6
        item.future.set_exception(
            DeadlineExceeded(
                f"model {self.label}: request waited {waited_ms:.0f} ms in the queue, past its "
                "deadline; it was not run"
            )
        )

    def _prune(self) -> None:
        """Drop requests that were cancelled or whose deadline passed while they waited."""
        if not self._items:
            return
        now = self._clock()
        kept: deque[Pending] = deque()
        late: list[Pending] = []
        delays = self._delays
        for item in self._items:
            if item.future.done():
                disarm([item])
                continue
            if item.deadline is not None and now >= item.deadline:
                disarm([item])
                self._expired(item)
                continue
            if delays and item.delay_at is not None and not item.delayed and now >= item.delay_at:
                late.append(item)  # its timer is due: moved back before any batch is formed
                continue
            kept.append(item)
        self._items = kept
        for item in late:
            self._delay(item)
        self._rows = sum(item.request.batch_size for item in self._items)
        self._sizes.count(self._items)


def _rank(item: Pending) -> int:
    return item.rank


def fail_all(items: Iterable[Pending], error: MpsdError) -> None:
    for item in items:
        if not item.future.done():
            item.future.set_exception(error)
