"""The daemon's event stream: every log event, classified and tagged, kept for replay and fanned out.

There is one source: a structlog processor publishes each log event here, so the log *is* the event
stream and nothing can be logged without being streamed (or the reverse). Publishing never blocks:
every subscriber has a bounded queue that loses its oldest events when the reader falls behind and
counts them, so a slow `mpsd logs` can never slow inference.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from mpsd.logs.levels import SEVERITIES

HISTORY = 2000
SUBSCRIBER_CAPACITY = 1000

# Fields that become an event's tags rather than entries of `fields`.
_TAGS = frozenset({"event", "level", "timestamp", "model", "version", "pid", "worker", "event_kind"})

# Exact messages of the daemon's lifecycle events; anything else falls back to the rules in `classify`.
_KIND_BY_MESSAGE = {
    "worker started": "worker",
    "worker stopped": "worker",
    "restarting worker": "worker",
    "worker ready again": "worker",
    "worker restart failed": "worker",
    "worker died": "crash",
    "worker hung": "crash",
    "worker ready": "device",
    "worker memory": "memory",
    "loading model": "load",
    "model version ready": "load",
    "model ready": "load",
    "model failed to load": "load",
    "model update failed; previous version keeps serving": "load",
    "unloading model": "load",
    "drain timed out": "load",
    "instance count changed": "load",
    "memory budget exceeded": "load",
    "out of memory": "oom",
    "request failed": "request",
}
KINDS = frozenset({*_KIND_BY_MESSAGE.values(), "reload", "stdout", "stderr", "mps_fallback", "daemon"})


@dataclass(frozen=True)
class Event:
    """One published log event; `fields` holds every field that is not a tag, rendered as text."""

    seq: int
    time: str
    level: str
    kind: str
    message: str
    model: str = ""
    version: int = 0
    pid: int = 0
    worker: str = ""
    fields: Mapping[str, str] = field(default_factory=dict)


def is_mps_fallback(line: str) -> bool:
    """PyTorch's warning for an operator MPS lacks: "... will fall back to run on the CPU"."""
    lowered = line.lower()
    return "mps" in lowered and ("fall back" in lowered or "fallback" in lowered)


def classify(message: str, fields: Mapping[str, Any]) -> str:
    """The event's kind; a log call can name it explicitly with `event_kind=`."""
    explicit = fields.get("event_kind")
    if isinstance(explicit, str) and explicit:
        return explicit
    source = fields.get("source")
    if source == "worker.stdout":
        return "stdout"
    if source == "worker.stderr":
        return "mps_fallback" if is_mps_fallback(message) else "stderr"
    kind = _KIND_BY_MESSAGE.get(message)
    if kind is not None:
        return kind
    lowered = message.lower()
    if "reload" in lowered or "reconcil" in lowered:
        return "reload"
    return "daemon"


def parse_label(label: str) -> tuple[str, int]:
    """(model, version) from a worker label `model/version#instance` or a version label `model/version`."""
    head = label.rpartition("#")[0] or label
    model, _, version = head.rpartition("/")
    if not model or not version.isdigit():
        return "", 0
    return model, int(version)


def _text(value: object) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, default=str)
    except ValueError:  # circular structures
        return repr(value)


def _int(value: object) -> int:
    try:
        return int(value)  # type: ignore[call-overload,no-any-return]
    except (TypeError, ValueError):
        return 0


def event_from_log(seq: int, event_dict: Mapping[str, Any]) -> Event:
    """Build an event from a structlog event dict (after add_log_level, TimeStamper, format_exc_info)."""
    message = str(event_dict.get("event", ""))
    worker = str(event_dict.get("worker") or "")
    model = str(event_dict.get("model") or "")
    version = _int(event_dict.get("version"))
    if worker and not model:
        model, parsed_version = parse_label(worker)
        version = version or parsed_version
    timestamp = event_dict.get("timestamp")
    if not isinstance(timestamp, str):
        timestamp = datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")
    return Event(
        seq=seq,
        time=timestamp,
        level=str(event_dict.get("level", "info")),
        kind=classify(message, event_dict),
        message=message,
        model=model,
        version=version,
        pid=_int(event_dict.get("pid")),
        worker=worker,
        fields={k: _text(v) for k, v in event_dict.items() if k not in _TAGS},
    )


@dataclass(frozen=True)
class EventFilter:
    """What a subscriber wants: one model ("" = all), a lowest level ("" = all), some kinds (empty = all)."""

    model: str = ""
    level: str = ""
    kinds: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if self.level and self.level not in SEVERITIES:
            raise ValueError(f"unknown level '{self.level}' (expected one of {', '.join(SEVERITIES)})")
        unknown = sorted(self.kinds - KINDS)
        if unknown:
            raise ValueError(
                f"unknown event kind(s) {', '.join(unknown)} (known: {', '.join(sorted(KINDS))})"
            )

    def matches(self, event: Event) -> bool:
        if self.model and event.model != self.model:
            return False
        if self.level and SEVERITIES.get(event.level, 0) < SEVERITIES[self.level]:
            return False
        return not self.kinds or event.kind in self.kinds


class Subscription:
    """One reader's bounded queue: filled by publishers on any thread, drained by one asyncio task."""

    def __init__(self, event_filter: EventFilter, capacity: int, lock: threading.Lock) -> None:
        self.filter = event_filter
        self.dropped_total = 0
        self._capacity = capacity
        self._lock = lock
        self._items: collections.deque[Event] = collections.deque()
        self._unreported = 0
        self._closed = False
        self._ready = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._thread = threading.get_ident()

    def offer(self, event: Event) -> None:
        """Queue the event, dropping the oldest queued one when full. Called with the bus lock held."""
        if len(self._items) >= self._capacity:
            self._items.popleft()
            self._unreported += 1
            self.dropped_total += 1
        self._items.append(event)
        self._wake()

    def close(self) -> None:
        """The reader gets what is queued, then the end of the stream. Called with the bus lock held."""
        self._closed = True
        self._wake()

    def _wake(self) -> None:
        if threading.get_ident() == self._thread:
            self._ready.set()
        elif not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._ready.set)

    async def get(self) -> tuple[Event, int] | None:
        """The next event and how many were dropped just before it; None once closed and drained."""
        while True:
            with self._lock:
                if self._items:
                    dropped, self._unreported = self._unreported, 0
                    return self._items.popleft(), dropped
                if self._closed:
                    return None
                self._ready.clear()
            await self._ready.wait()


Listener = Callable[[Event], None]


class EventBus:
    """A ring buffer of recent events for replay, plus live subscribers and synchronous listeners."""

    def __init__(self, history: int = HISTORY, capacity: int = SUBSCRIBER_CAPACITY) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._history: collections.deque[Event] = collections.deque(maxlen=history)
        self._subscribers: list[Subscription] = []
        self._listeners: list[Listener] = []
        self._seq = itertools.count(1)

    def publish(self, event_dict: Mapping[str, Any]) -> Event:
        """Record one log event; never blocks on a reader. Listeners run in the caller's thread."""
        with self._lock:
            event = event_from_log(next(self._seq), event_dict)
            self._history.append(event)
            for sub in self._subscribers:
                if sub.filter.matches(event):
                    sub.offer(event)
            listeners = list(self._listeners)
        for listener in listeners:
            listener(event)
        return event

    def recent(self, event_filter: EventFilter, count: int) -> list[Event]:
        with self._lock:
            return self._recent(event_filter, count)

    def _recent(self, event_filter: EventFilter, count: int) -> list[Event]:
        if count <= 0:
            return []
        matching = [e for e in self._history if event_filter.matches(e)]
        return matching[-count:]

    def subscribe(
        self, event_filter: EventFilter, replay: int = 0, capacity: int | None = None
    ) -> tuple[list[Event], Subscription]:
        """The last `replay` matching events and a subscription starting right after them (no gap)."""
        with self._lock:
            sub = Subscription(event_filter, capacity or self.capacity, self._lock)
            self._subscribers.append(sub)
            return self._recent(event_filter, replay), sub

    def unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            if sub in self._subscribers:
                self._subscribers.remove(sub)

    def close_subscriptions(self) -> None:
        """End every live stream (shutdown: an open stream would hold the gRPC drain)."""
        with self._lock:
            for sub in self._subscribers:
                sub.close()
            self._subscribers.clear()

    def add_listener(self, listener: Listener) -> Callable[[], None]:
        """Call `listener` for every event, in the publishing thread; returns the function that removes it."""
        with self._lock:
            self._listeners.append(listener)

        def remove() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)

        return remove


BUS = EventBus()


def publish_processor(logger: object, method_name: str, event_dict: Any) -> Any:
    """structlog processor: publish the event to the daemon's bus and pass it on unchanged."""
    BUS.publish(event_dict)
    return event_dict
