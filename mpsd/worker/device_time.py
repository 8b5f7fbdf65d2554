"""The device's own time for one execution, from timing events recorded around the model call.

Host clocks around the call measure launch and wait as much as work: the device's queue runs behind the
thread that fills it. Two timing events on the device's stream, one before the model call and one after,
give the time the device itself spent between them. They are read only after the worker has synchronized
for the outputs anyway, so measuring adds no wait: `elapsed_time` on completed events is a lookup.

CUDA (`torch.cuda.Event`) and MPS (`torch.mps.event.Event`) share the API used here: a constructor taking
`enable_timing`, `record()` (the current stream; MPS has only its default one) and `elapsed_time(end_event)`
in milliseconds. The CPU has no device time: `timing_events` answers None and nothing is reported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch


class TimingEvent(Protocol):
    """What the worker uses of a timing event (torch.cuda.Event, torch.mps.event.Event)."""

    def record(self) -> None: ...

    def elapsed_time(self, end_event: Any) -> float: ...  # milliseconds


EventFactory = Callable[[], TimingEvent]


def _cuda_event() -> TimingEvent:
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


def _mps_event() -> TimingEvent:
    return torch.mps.event.Event(enable_timing=True)


def timing_events(device_type: str) -> EventFactory | None:
    """How to make a timing event on this kind of device; None on the CPU (no device time there)."""
    if device_type == "cuda":
        return _cuda_event
    if device_type == "mps":
        return _mps_event
    return None


class ExecutionTimer:
    """Two events, recorded around each model call and reused from one execution to the next."""

    def __init__(self, new_event: EventFactory) -> None:
        self._start = new_event()
        self._end = new_event()

    def start(self) -> None:
        """Just before the model call: after the inputs' copies were queued, so they are not counted."""
        self._start.record()

    def stop(self) -> None:
        """Just after the model call returned (its work may still be queued)."""
        self._end.record()

    def elapsed_ns(self) -> int:
        """Device time from start to stop; only once the device has synchronized past `stop`."""
        return max(0, round(self._start.elapsed_time(self._end) * 1_000_000))
