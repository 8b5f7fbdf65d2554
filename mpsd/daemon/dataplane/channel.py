"""The execution channel to one worker: the frames on its socket, and what each message from the worker
means for the executions in flight, the worker's signs of life and its profiles.

The executions themselves (a seat's shared memory, the Infer frame, the wait for the answer) are
`execution.py`'s, which `Channel` inherits; the caller lays out, writes and reads the tensors (`Tensors`).
"""

from __future__ import annotations

import asyncio
import itertools
import socket
from collections.abc import Callable
from typing import Protocol

from mpsd.daemon.dataplane.arenas import WorkerArenas
from mpsd.daemon.dataplane.calls import CallHandler, CallRouter
from mpsd.daemon.dataplane.execution import Executions, region_ref
from mpsd.daemon.dataplane.profiling import ProfileRun
from mpsd.errors import ResourceExhausted, WorkerDied
from mpsd.ipc import protocol as p
from mpsd.ipc.framing import FrameProtocol, encode
from mpsd.ipc.shm import Region, page_round
from mpsd.net import eventloop

# Silence allowed of a worker from the start of a profile until its ProfileDone: ending the profile and
# exporting its trace hold the worker's interpreter for seconds after a long window on a busy model.
PROFILE_PATIENCE_S = 120.0


INITIAL_REGION = 1 << 20


class SeatRegions:
    """The shared memory of one seat, owned by the daemon: reused from request to request and only replaced
    (by a region twice as large) when a request does not fit, so no request allocates shared memory. A new
    region's name is unlinked once the worker has mapped it. Not a front's arena (`ipc/front_arena.py`),
    which holds requests on their way from a front to the daemon."""

    def __init__(self) -> None:
        self.input: Region | None = None
        self.output: Region | None = None
        self.named = False  # a region still has its name: the worker has not answered through it yet
        self._mapped: list[Region] = []

    def input_for(self, nbytes: int) -> Region:
        """The input region, replaced by a larger one first if `nbytes` do not fit."""
        if self.input is None or self.input.size < nbytes:
            old = self.input
            self.input = self._new(max(nbytes, INITIAL_REGION, 2 * (old.size if old else 0)))
            if old is not None:
                self._retire(old)
        return self.input

    def output_region(self) -> Region:
        if self.output is None:
            self.output = self._new(INITIAL_REGION)
        return self.output

    def grow_output(self, nbytes: int) -> p.RegionRef:
        """A larger output region for the request in progress (the worker asked with NeedOutput)."""
        old = self.output
        self.output = self._new(max(nbytes, 2 * (old.size if old else 0)))
        if old is not None:
            self._retire(old)
        return region_ref(self.output)

    def mapped_by_worker(self) -> None:
        """The worker answered a request using both regions: their names are no longer needed."""
        self.named = False
        for region in (self.input, self.output):
            if region is not None:
                region.unlink()

    def release(self) -> None:
        for region in self._mapped:
            region.unlink()
            region.close()
        self._mapped.clear()
        self.input = self.output = None

    def _new(self, size: int) -> Region:
        region = Region.create(page_round(size))
        self._mapped.append(region)
        self.named = True
        return region

    def _retire(self, region: Region) -> None:
        region.unlink()
        if region.close():
            self._mapped.remove(region)


class Signs(Protocol):
    """Where the channel reports the worker's signs of life (supervision's `Liveness`): every message counts
    as one, memory snapshots are handed on, and a profile widens the silence allowed."""

    last_seen: float
    patience_s: float

    def snapshot(self, memory: dict[str, int]) -> None: ...


class Channel(Executions):
    """`hung(reason)` is called when an execution gets no answer within `request_timeout_s` (0: no limit);
    every message counts as a sign of life for `liveness`, and memory snapshots go to it."""

    seats: tuple[SeatRegions, ...]  # each seat's shared memory, which the channel owns

    def __init__(
        self,
        model: p.ModelSpec,
        liveness: Signs,
        request_timeout_s: float,
        hung: Callable[[str], None],
        label: str = "",
        calls: CallHandler | None = None,
    ) -> None:
        self.model = model
        self.label = label  # the worker's, for the log
        self.pid: int | None = None  # the worker's, once it runs
        self.liveness = liveness
        self.request_timeout_s = request_timeout_s
        self.refusing = False  # the worker is stopping or gone: no execution is sent any more
        self.overlaps = False  # its worker launches an execution behind the running one (its Ready says)
        self._hung = hung
        self._transport: asyncio.Transport | None = None
        self._reply: asyncio.Future[object] | None = None
        self._closed: Callable[[], None] = lambda: None
        self.seats = tuple(SeatRegions() for _ in range(p.SEATS))
        super().__init__()  # the executions in flight (`execution.py`)
        self.profile: ProfileRun | None = None  # the one profile of this worker under way
        self._profile_ids = itertools.count(1)
        self.arenas = WorkerArenas(self._forget_arena)  # the fronts' arenas the worker has mapped
        self.calls = CallRouter(calls if model.backend == "python" else None)  # a python model's calls

    def _forget_arena(self, arena_id: int) -> None:
        if self._transport is not None and not self.refusing:
            self._transport.write(encode(p.ForgetArena(arena_id)))

    def expect_reply(self) -> asyncio.Future[object]:
        """The next message from the worker, whatever it is (the answer to Init); fails with ConnectionError
        if the worker closes the channel first."""
        self._reply = asyncio.get_running_loop().create_future()
        return self._reply

    async def connect(self, sock: socket.socket, closed: Callable[[], None]) -> None:
        """Take over the daemon's end of the worker's socket; `closed` is called once the worker's end
        closes."""
        self._closed = closed
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_unix_connection(
            lambda: FrameProtocol(self._on_message, self._on_closed), sock=sock
        )
        self._transport = self.calls.transport = transport
        eventloop.wake_at_once(sock)  # the batch behind an answer waits on it: a gathering loop wakes for it

    @property
    def connected(self) -> bool:
        return self._transport is not None

    def send(self, msg: object) -> None:
        assert self._transport is not None
        self._transport.write(encode(msg))

    def _on_message(self, msg: object) -> None:
        """Every message from the worker, handled as it arrives (in the socket's read callback)."""
        self.liveness.last_seen = asyncio.get_running_loop().time()
        if self._reply is not None:  # loading: the first other message is the answer to Init
            if not self._reply.done():
                self._reply.set_result(msg)
            self._reply = None
        elif isinstance(msg, p.NeedOutput):
            entry = self._inflight.get(msg.req_id)
            if entry is not None:
                self._grow_output(entry[1], msg.nbytes)
        elif isinstance(msg, p.MemorySnapshot):
            self.liveness.snapshot(msg.memory)
        elif isinstance(msg, p.StreamPart):
            parts = self._parts.get(msg.req_id)
            if parts is not None:
                parts.put_nowait(msg)
        elif isinstance(msg, (p.InferDone, p.InferFailed)):
            entry = self._inflight.pop(msg.req_id, None)
            if self.calls.handler is not None:  # a model that may call others
                self.calls.answered(msg.req_id)
            if entry is None:
                return
            if msg.req_id in self._abandoned:
                self._abandoned.discard(msg.req_id)
                self._give_seat(entry[1])
            elif not entry[0].done():
                entry[0].set_result(msg)
        elif isinstance(msg, (p.Call, p.CallAck)):
            self.calls.received(msg)
        elif isinstance(msg, (p.ProfileStarted, p.ProfileChunk, p.ProfileDone, p.ProfileFailed)):
            current = self.profile is not None and msg.profile_id == self.profile.profile_id
            if isinstance(msg, (p.ProfileDone, p.ProfileFailed)) and (current or self.profile is None):
                self.liveness.patience_s = 0.0  # the worker's profile is over: the usual timeout again
            if current and self.profile is not None:
                self.profile.deliver(msg)

    def _on_closed(self, exc: Exception | None) -> None:
        if self._reply is not None and not self._reply.done():
            self._reply.set_exception(ConnectionError("the worker closed its channel"))
        self._closed()

    def fail(self, message: str) -> None:
        """The worker is gone: every execution in flight fails with WorkerDied(message), and no other is
        sent."""
        self.refusing = True
        self.arenas.close()
        self.calls.close(WorkerDied(message))
        if self.profile is not None:
            self.profile.fail(WorkerDied(message.replace("while running the request", "while profiling")))
        inflight = list(self._inflight.items())
        self._inflight.clear()
        for req_id, (pending, seat) in inflight:
            if req_id in self._abandoned:
                self._give_seat(seat)
            elif not pending.done():
                pending.set_exception(WorkerDied(message))
        self._abandoned.clear()

    def start_profile(self, requests: int, mps_gpu_trace: bool) -> ProfileRun:
        """Ask the worker to start profiling; ResourceExhausted while another profile of it is under way."""
        model = self.model
        if self.profile is not None:
            raise ResourceExhausted(
                f"model '{model.name}' version {model.version}: this worker is already being profiled; "
                "wait for that profile to end (one at a time per worker)"
            )
        if self.refusing or self._transport is None:
            raise WorkerDied(f"model '{model.name}' version {model.version}: worker is not running")
        run = self.profile = ProfileRun(next(self._profile_ids))
        self.liveness.patience_s = PROFILE_PATIENCE_S
        self.send(p.StartProfile(run.profile_id, requests, mps_gpu_trace))
        return run

    def stop_profile(self, run: ProfileRun) -> None:
        """End the window now (its time is up, or its client went away)."""
        if self.profile is run and not run.finished and not self.refusing and self._transport is not None:
            self.send(p.StopProfile(run.profile_id))

    def end_profile(self, run: ProfileRun) -> None:
        """The caller is done with the run: the next profile may start (stopping it first if needed)."""
        if self.profile is run:
            self.stop_profile(run)
            self.profile = None

    def close(self) -> None:
        """Close the socket and unmap the seats' regions."""
        self.arenas.close()
        if self._transport is not None:
            self._transport.close()
        self.release()

    def _grow_output(self, seat: int, nbytes: int) -> None:
        region = self.seats[seat].grow_output(nbytes)
        assert self._transport is not None
        self._transport.write(encode(p.OutputRegion(region)))

    def release(self) -> None:
        """Unmap the seats' regions (an execution still running finds them gone)."""
        for regions in self.seats:
            regions.release()
