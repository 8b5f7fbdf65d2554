"""A model's priorities: its priority levels and their queue policies (Triton's `priority_levels`,
`default_queue_policy` and `priority_queue_policy`), as the queue applies them.

A request's level is its `priority` parameter, or the model's default level for 0 and for a number past
`priority_levels` (Triton's rule). The queue keeps its requests ordered by rank: a smaller level first, and
within a level the requests whose timeout has not expired before those a DELAY policy has moved back
(`Pending.delayed`), each part in arrival order. A model with one level and no DELAY gives every request the
same rank, and the queue is a plain first-in first-out one.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from mpsd.config.model_config import DynamicBatching, QueuePolicy
from mpsd.daemon.dataplane.request import InferRequest
from mpsd.errors import Unavailable


@dataclass(frozen=True)
class Policy:
    """One queue policy in the queue's units."""

    max_size: int  # requests of the level queued at once; 0: no limit
    timeout_s: float  # the level's timeout; 0: none
    delay: bool  # timeout_action DELAY: an expired request moves back instead of failing
    override: bool  # allow_timeout_override: a request's `timeout` parameter may shorten timeout_s

    @classmethod
    def of(cls, policy: QueuePolicy) -> Policy:
        return cls(
            policy.max_queue_size,
            policy.default_timeout_microseconds / 1e6,
            policy.timeout_action == "DELAY",
            policy.allow_timeout_override,
        )

    def timeout(self, request: InferRequest) -> float:
        """The request's timeout in seconds (0: none): the level's, or the request's own where it may
        override it and it is shorter (no timeout being the longest)."""
        own = request.timeout_us / 1e6 if self.override else 0.0
        if own and (not self.timeout_s or own < self.timeout_s):
            return own
        return self.timeout_s


NO_POLICY = Policy(0, 0.0, False, False)


class Priorities:
    """A model's priority levels: which a request is on and that level's policy. `timed`: some level has a
    timeout or lets a request set one; `delays`: some DELAY policy can move a request back; `ordered`:
    requests can have different ranks (several levels, or `delays`); `counted`: there are several levels
    and one has a size limit, so the queue counts its requests level by level."""

    def __init__(self, db: DynamicBatching | None) -> None:
        self._db = db
        self.default = Policy.of(db.default_policy) if db is not None else NO_POLICY
        self._own = {n: Policy.of(p) for n, p in db.priority_queue_policy.items()} if db is not None else {}
        self.several = db is not None and db.priority_levels > 0
        policies = [self.default, *self._own.values()]
        self.timed = any(p.timeout_s or p.override for p in policies)
        self.delays = any(p.delay and (p.timeout_s or p.override) for p in policies)
        self.ordered = self.several or self.delays
        self.counted = self.several and any(p.max_size for p in policies)

    def level(self, request: InferRequest) -> int:
        db = self._db
        return db.level(request.priority) if db is not None and self.several else 0

    def policy(self, level: int) -> Policy:
        return self._own.get(level, self.default)


class Queued(Protocol):
    """A queued request, as ranked and counted here (the queue's `Pending`)."""

    @property
    def level(self) -> int: ...

    @property
    def rank(self) -> int: ...


Q = TypeVar("Q", bound=Queued)


def place(items: deque[Q], item: Q) -> None:
    """Put `item` behind every queued request of its rank or a smaller one, ahead of the larger ranks
    (looking from the back: an arrival usually belongs there, or close)."""
    i, rank = len(items), item.rank
    while i and items[i - 1].rank > rank:
        i -= 1
    items.insert(i, item)


class Sizes:
    """The queued requests of each level, kept only where `counted` (`Priorities.counted`)."""

    def __init__(self, counted: bool) -> None:
        self.counted = counted
        self._counts: dict[int, int] = {}

    def of(self, level: int) -> int:
        return self._counts.get(level, 0)

    def add(self, level: int) -> None:
        if self.counted:
            self._counts[level] = self._counts.get(level, 0) + 1

    def remove(self, item: Queued) -> None:
        if self.counted:
            left = self._counts[item.level] - 1
            if left:
                self._counts[item.level] = left
            else:
                del self._counts[item.level]

    def count(self, items: Iterable[Queued]) -> None:
        """Count again, from what is queued."""
        if self.counted:
            self._counts = dict(Counter(item.level for item in items))


def queue_full(request: InferRequest) -> Unavailable:
    """Triton's answer to a request beyond its level's max_queue_size."""
    return Unavailable(f"[request id: {request.id or '<id_unknown>'}] Exceeds maximum queue size")


def timeout_expired() -> Unavailable:
    """Triton's answer to a request whose level's timeout expired under timeout_action REJECT."""
    return Unavailable("Request timeout expired")
