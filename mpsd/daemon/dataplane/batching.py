"""Batch forming on a model version's request queue: which queued requests go together, and when.

With dynamic batching, compatible requests (same datatypes and same shapes apart from the batch dimension)
are taken in arrival order up to `max_batch_size` rows, waiting at most `max_queue_delay_microseconds` for
more. Incompatible requests are never mixed; they wait for a batch of their own. With no queue delay, a
batch short of full goes once the daemon's loop has settled (`mpsd.net.settle`): the requests already on
their way join it instead of each taking an execution of its own. What is queued, in which order, and
until when is the queue's (`queue.py`), whose `RequestQueue` inherits these methods.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import operator
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Awaitable, Callable, Hashable, Iterable
from typing import Generic, Protocol, TypeVar

from mpsd.daemon.dataplane.priorities import Queued, Sizes
from mpsd.daemon.dataplane.request import InferRequest


class Alarmed(Protocol):
    """What answers a queued request at its deadline (`alarms.Alarm`): cancelled when it leaves the queue."""

    def cancel(self) -> None: ...


class Batchable(Queued, Protocol):
    """A queued request, as batched here (the queue's `Pending`)."""

    request: InferRequest
    enqueued_ns: int
    timer: Alarmed | None  # answers it at its deadline while it is queued

    @property
    def key(self) -> Hashable: ...


Item = TypeVar("Item", bound=Batchable)  # the queue's `Pending`


class BatchForming(ABC, Generic[Item]):
    """The batch forming half of `RequestQueue`: an instance's dispatcher waits here for its next batch."""

    # The queue's, set by `RequestQueue.__init__`.
    batching: bool
    max_rows: int
    target_rows: int
    delay_s: float
    _items: deque[Item]
    _rows: int
    _sizes: Sizes
    _waiting: list[int]
    _arrived: asyncio.Event
    _settle: Callable[[], Awaitable[None]]
    _gathering: int
    last_batch_full = False  # the last batch formed here (`next_batch`, `gather`) reached the target
    _clock_ns: Callable[[], int]

    @property
    def gathers(self) -> bool:
        """Batching with no queue delay: a short batch waits for the loop to settle, and no longer."""
        return self.batching and self.delay_s <= 0

    @abstractmethod
    def _prune(self) -> None:
        """Drop what may not go any more before a batch is formed (the queue's)."""

    def _form(self) -> tuple[list[Item], int]:
        """The next batch: the oldest request plus later compatible ones, up to max rows."""
        head = self._items[0]
        return self._joining([head], head.request.batch_size, list(self._items)[1:])

    def _joining(self, batch: list[Item], rows: int, candidates: Iterable[Item]) -> tuple[list[Item], int]:
        """`batch` (`rows` rows) with the candidates that fit it, in order, up to max rows."""
        if self.batching:
            key = batch[0].key
            for item in candidates:
                if rows >= self.max_rows:
                    break
                if item.key == key and rows + item.request.batch_size <= self.max_rows:
                    batch.append(item)
                    rows += item.request.batch_size
        return batch, rows

    def _take(self, batch: list[Item], rows: int) -> None:
        """Remove queued members of `batch` (`rows` rows of them)."""
        items, n = self._items, len(batch)
        if n <= len(items) and all(map(operator.is_, itertools.islice(items, n), batch)):
            # The usual case, the batch is the head of the queue: cut it off without a Python-level loop.
            self._items = deque(itertools.islice(items, n, None))
        else:
            taken = {id(i) for i in batch}
            self._items = deque(i for i in items if id(i) not in taken)
        self._rows -= rows
        if self._sizes.counted:
            for item in batch:
                self._sizes.remove(item)
        disarm(batch)
        if self._items:
            self._arrived.set()  # what is left, for another instance's dispatcher

    async def gather(self, batch: list[Item]) -> list[Item]:
        """`batch`, which skipped the queue for a free instance, with the compatible requests that arrive
        while the loop settles (`gathers`); meanwhile arrivals queue behind it."""
        rows = sum(item.request.batch_size for item in batch)
        if not self.gathers or rows >= self.target_rows:
            self.last_batch_full = rows >= self.target_rows
            return batch
        self._gathering += 1
        try:
            await self._settle()
        finally:
            self._gathering -= 1
        self._prune()
        own = len(batch)
        batch, total = self._joining(list(batch), rows, self._items)
        self._take(batch[own:], total - rows)
        self.last_batch_full = total >= self.target_rows
        return batch

    async def next_batch(self, partial: Callable[[], bool] | None = None) -> list[Item]:
        """Wait for work and return it; with batching, wait up to the queue delay for a fuller batch.

        `partial`: whether a batch short of the target may go now that its delay is over. While it says
        no (its instance is still running another execution, whose end the caller signals with `wake`),
        only a full batch goes: requests keep gathering meanwhile, instead of a small batch waiting behind
        the running one with no gain in latency.
        """
        settled = False  # a short batch waits for one settle of the loop (`gathers`)
        while True:
            self._prune()
            if not self._items:
                await self._wait(1)
                continue
            head = self._items[0]
            # Fewer rows queued than a full batch: short for certain, not worth forming yet.
            batch: list[Item] | None = None
            short = self.batching and self._rows < self.target_rows
            if not short:
                batch, rows = self._form()
                short = self.batching and rows < self.target_rows
            remaining = 0.0
            if short and self.delay_s > 0:
                remaining = self.delay_s - (self._clock_ns() - head.enqueued_ns) / 1e9
            if remaining <= 0 and (not short or partial is None or partial()):
                if short and self.gathers and not settled:
                    settled = True
                    await self._settle()
                    continue
                if batch is None:
                    batch, rows = self._form()
                self._take(batch, rows)
                self.last_batch_full = rows >= self.target_rows
                return batch
            wanted = self._rows + 1 if batch is not None else self.target_rows
            if remaining <= 0:
                await self._wait(wanted)  # a fuller batch, or `wake`
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wait(wanted), remaining)

    async def _wait(self, rows: int) -> None:
        """Until `rows` rows are queued, something is put back, or `wake`."""
        self._waiting.append(rows)
        self._arrived.clear()
        try:
            await self._arrived.wait()
        finally:
            self._waiting.remove(rows)

    def wake(self) -> None:
        """Have a waiting `next_batch` look again (its `partial` may say yes now)."""
        self._arrived.set()


def disarm(items: Iterable[Batchable]) -> None:
    """Cancel the items' alarms: they left the queue."""
    for item in items:
        if item.timer is not None:
            item.timer.cancel()
            item.timer = None
