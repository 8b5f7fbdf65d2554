"""Completion events: the point in the device's queue past which one execution's work (its model call and
the copies of its outputs to the host) is done, so the worker can wait for that execution alone while the
next one is already queued behind it.

Only CUDA has them here: its copies to page-locked host memory run in the queue's order, and an event
recorded after them completes when they have landed. On MPS reading an output waits for everything queued,
so a second execution in the queue would delay the first one's answer; there, and on the CPU, `completion`
answers None and executions run one at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch


class Completion(Protocol):
    """What the worker uses of a completion event (torch.cuda.Event without timing)."""

    def record(self) -> None: ...

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


CompletionFactory = Callable[[], Completion]


def _cuda_completion() -> Completion:
    return torch.cuda.Event()  # type: ignore[no-untyped-call]


def completions(device_type: str) -> CompletionFactory | None:
    """How to make a completion event on this kind of device, or None: executions there run one at a time."""
    return _cuda_completion if device_type == "cuda" else None
