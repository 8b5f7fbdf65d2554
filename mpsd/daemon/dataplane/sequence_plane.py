"""The data plane of a model version with sequence batching: `VersionPlane` with its requests routed by
sequence (`sequences.py`) instead of the plain queue, and its lanes pulling from their own slots.

Chosen by `plane_for` when the config has `sequence_batching`, so a model without it runs the plain plane
and pays nothing for this one.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from mpsd.config.model_config import ModelConfig
from mpsd.daemon.dataplane.channel import Channel
from mpsd.daemon.dataplane.lane import Lane
from mpsd.daemon.dataplane.marshal import BatchTensors
from mpsd.daemon.dataplane.plane import Batch, VersionLane, VersionPlane
from mpsd.daemon.dataplane.queue import Pending
from mpsd.daemon.dataplane.request import InferRequest
from mpsd.daemon.dataplane.sequences import LaneSlots, SequenceScheduler
from mpsd.errors import MpsdError


class SequenceTensors(BatchTensors):
    """An execution's tensors, with each row's sequence slot and start flag for the worker's state."""

    __slots__ = ("sequence",)

    def __init__(self, requests: Sequence[InferRequest], waiting: Sequence[Any]) -> None:
        super().__init__(requests, waiting)
        self.sequence = tuple(
            (r.sequence.slot, r.sequence.start) if r.sequence is not None else (-1, False) for r in requests
        )


class SequenceLane(Lane[Batch, Channel]):
    """A lane whose worker holds its sequences' state: losing or replacing the worker loses them."""

    def __init__(
        self,
        slots: LaneSlots,
        execute: Callable[[Batch, Channel], Awaitable[None]],
        lanes: Callable[[], Sequence[Lane[Batch, Channel]]],
        down: Callable[[], None],
    ) -> None:
        super().__init__(slots, execute, lanes, down)
        self.slots = slots

    def attach(self, channel: Channel) -> None:
        scheduler = self.slots.scheduler
        if self.channel is not None and self.channel is not channel:
            scheduler.lane_lost(self.slots, "its instance's worker was replaced")
        super().attach(channel)
        self.slots.serving = True
        scheduler.lane_serving(self.slots)

    def detach(self, reason: str) -> None:
        self.slots.serving = False
        self.slots.scheduler.lane_lost(self.slots, f"its instance's worker stopped: {reason}")
        super().detach(reason)


class SequencePlane(VersionPlane):
    tensors_type: type[BatchTensors] = SequenceTensors

    def __init__(self, name: str, version: int, config: ModelConfig) -> None:
        super().__init__(name, version, config)
        self.sequences = SequenceScheduler(name, version, config)
        if not (config.sequence_batching is not None and config.sequence_batching.state):
            self.tensors_type = BatchTensors  # no state in the worker: its executions need no slots

    def new_lane(self) -> VersionLane:
        return SequenceLane(self.sequences.new_lane(), self.execute, self._all_lanes, self._lane_down)

    @property
    def holding(self) -> int:
        """Live sequences: their state is in the workers, so the model is in use between their requests."""
        return self.sequences.active

    def holds(self, request: InferRequest) -> bool:
        """A live sequence's request, while a lane serves: a version that is closing still takes it."""
        return self.sequences.holds(request) and any(lane.serving for lane in self.lanes)

    async def drained(self) -> None:
        """Until no request is in flight and no sequence is live."""
        while True:
            await self.flight.idle.wait()
            if not self.sequences.active:
                return
            self.sequences.freed.clear()
            await self.sequences.freed.wait()

    def _free_lane(self, item: Pending) -> tuple[VersionLane, Channel] | None:
        return None  # a sequence's request always goes through its sequence's slot

    def _admit(self, item: Pending, queued: bool = True) -> None:
        try:
            self.sequences.put(item)
        except MpsdError as exc:
            self.stats.record_failure(0, exc.code.value)
            raise

    def fail_queued(self, error: MpsdError) -> None:
        super().fail_queued(error)
        self.sequences.fail_all(error)


def plane_for(name: str, version: int, config: ModelConfig) -> VersionPlane:
    """The data plane for a model version: with sequence batching, or the plain one."""
    if config.sequence_batching is not None:
        return SequencePlane(name, version, config)
    return VersionPlane(name, version, config)
