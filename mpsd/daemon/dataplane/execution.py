"""One execution on a worker's channel, from taking a seat to reading the results out of it.

A worker has `SEATS` seats: each is one execution's place in the worker, with its own input and output
regions of shared memory, so the next batch can wait in the worker's socket while the current one runs.
The channel (`channel.py`) owns the socket, the worker's messages and its profiles; what happens to one
batch on it is here, in named steps: take a seat, write the inputs into the seat's input region, send the
Infer frame, wait for the answer (or the request timeout, or a stream's parts), mark an execution nobody
waits for any more abandoned, and read the results. `Channel` inherits these methods, so a request pays for
no extra object or lookup on its way. (A seat is not a sequence batcher's slot: a sequence model's rows
name their sequence slots in the same Infer frame, `sequence`.)
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar, cast

from mpsd.daemon.dataplane.arenas import WorkerArenas
from mpsd.daemon.dataplane.calls import CallRouter, Chain
from mpsd.daemon.dataplane.tensors import PhaseTimes, Tensors
from mpsd.errors import DeadlineExceeded, Internal, WorkerDied, error_from_code
from mpsd.ipc import protocol as p
from mpsd.ipc.framing import encode
from mpsd.ipc.shm import Region

T = TypeVar("T")


class Seat(Protocol):
    """A seat's shared memory, as an execution uses it (the channel's `SeatRegions`)."""

    output: Region | None
    named: bool  # a region is new: the worker has not answered through it yet

    def input_for(self, nbytes: int) -> Region: ...

    def output_region(self) -> Region: ...

    def mapped_by_worker(self) -> None: ...


class _Abandoned(Exception):
    """The caller stopped waiting (cancelled, or the deadline passed) before the worker answered: the
    execution's seat stays taken until it does."""

    def __init__(self, cause: BaseException) -> None:
        self.cause = cause


class Executions:
    """The executions in flight on one worker's channel: up to `p.SEATS` at a time, each with its own input
    and output regions, so the next batch can wait in the worker's socket while the current one runs."""

    # The channel's, set by `Channel.__init__`.
    model: p.ModelSpec
    refusing: bool
    request_timeout_s: float
    arenas: WorkerArenas
    calls: CallRouter
    seats: tuple[Seat, ...]  # each seat's shared memory
    _transport: asyncio.Transport | None
    _hung: Callable[[str], None]

    def __init__(self) -> None:
        self._req_ids = itertools.count(1)
        self._free_seats = list(range(p.SEATS))[::-1]
        self._seat_freed = asyncio.Event()
        self._inflight: dict[int, tuple[asyncio.Future[object], int]] = {}  # req_id -> (answer, seat)
        self._abandoned: set[int] = set()  # executions nobody waits for: their seat is freed on the answer
        self._parts: dict[int, asyncio.Queue[p.StreamPart]] = {}  # req_id -> a stream's parts not yet read

    async def _take_seat(self) -> int:
        while not self._free_seats:
            self._seat_freed.clear()
            await self._seat_freed.wait()
        return self._free_seats.pop()

    def _give_seat(self, seat: int) -> None:
        self._free_seats.append(seat)
        self._seat_freed.set()

    async def infer_batch(
        self,
        tensors: Tensors[T],
        timings: PhaseTimes,
        waiting: Sequence[asyncio.Future[Any]] = (),
        deadline: float | None = None,
        on_part: Callable[[T], Awaitable[bool]] | None = None,
        chain: Chain = frozenset(),
    ) -> T:
        """Run one execution: `tensors` writes its inputs straight into the seat's shared memory and reads
        its results out of it; `timings` gets the phases (the daemon's own writing and reading included).

        Takes one of the worker's seats for the execution; with both in use it waits for one to free up.
        Once every future in `waiting` is done (the callers went away) or `deadline` (time.monotonic(), the
        latest of the requests') has passed, an execution the worker has not started yet is skipped.
        """
        seat = await self._take_seat()
        kept = False  # the worker still uses the seat after this call ends: it is freed when it answers
        try:
            return await self._run_in_seat(seat, tensors, timings, waiting, deadline, on_part, chain)
        except _Abandoned as abandoned:
            kept = True
            raise abandoned.cause from None
        finally:
            if not kept:
                self._give_seat(seat)

    async def _run_in_seat(
        self,
        seat: int,
        tensors: Tensors[T],
        timings: PhaseTimes,
        waiting: Sequence[asyncio.Future[Any]],
        deadline: float | None,
        on_part: Callable[[T], Awaitable[bool]] | None = None,
        chain: Chain = frozenset(),
    ) -> T:
        """Write, send, wait, read: the steps of one execution in `seat`."""
        if self.refusing or self._transport is None:
            raise self._not_running()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        regions = self.seats[seat]
        in_region = regions.input_for(tensors.lay_out())
        buf = in_region.buf
        pieces = self._write_inputs(buf, tensors)
        out = regions.output_region()
        wanted = tensors.outputs()
        write_ns = int((loop.time() - t0) * 1e9)
        req_id = next(self._req_ids)
        msg = p.Infer(
            req_id,
            tensors.refs,
            wanted,
            region_ref(in_region),
            region_ref(out),
            seat,
            time.monotonic_ns(),
            max(1, len(waiting)),
            pieces,
            tensors.parameters(),
            tensors.sequence,  # a sequence model's rows: their sequence slots, else ()
            timings.trace,
        )
        pending = self._send(msg, chain, deadline, waiting, loop)
        unwatch = watch(buf, waiting, deadline, loop, self._expiry(pending))
        try:
            if on_part is None:
                reply = await self._wait_reply(req_id, pending)
            else:
                reply = await self._stream_parts(req_id, pending, tensors, seat, on_part)
        except BaseException as exc:
            if req_id in self._inflight:  # no answer yet: the worker may still use the seat
                raise self._abandon(req_id, buf, exc) from None
            raise
        finally:
            unwatch()
        return self._results(reply, req_id, regions, tensors, timings, write_ns, on_part is not None, loop)

    async def _stream_parts(
        self,
        req_id: int,
        pending: asyncio.Future[object],
        tensors: Tensors[T],
        seat: int,
        on_part: Callable[[T], Awaitable[bool]],
    ) -> object:
        """A decoupled model's request: each part is read out of the seat's output region, handed to
        `on_part` (which may take its time: the worker waits for the acknowledgement, so a slow consumer
        holds the model back), and acknowledged, with `stop` once `on_part` says nobody wants more. Returns
        the worker's final answer."""
        parts: asyncio.Queue[p.StreamPart] = asyncio.Queue()
        self._parts[req_id] = parts
        try:
            while True:
                getter = asyncio.ensure_future(parts.get())
                try:
                    waits: set[asyncio.Future[Any]] = {getter, pending}
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    getter.cancel()
                if getter.done() and not getter.cancelled():
                    part = getter.result()
                    regions = self.seats[seat]
                    if regions.output is None:
                        raise WorkerDied(
                            f"model '{self.model.name}' version {self.model.version}: worker died"
                        )
                    results = tensors.read(part.outputs, regions.output_region().buf)
                    keep = await on_part(results)
                    if self._transport is not None:
                        self._transport.write(encode(p.StreamAck(req_id, part.index, stop=not keep)))
                    continue
                return pending.result()  # the end, or the error (DeadlineExceeded before the start)
        finally:
            self._parts.pop(req_id, None)

    async def _wait_reply(self, req_id: int, pending: asyncio.Future[object]) -> object:
        """The worker's answer (or DeadlineExceeded, set on `pending` when the deadline passed before the
        worker started the execution); past the request timeout the worker counts as hung and is killed.

        The timeout counts from when the execution is the oldest in flight: one sent while another runs
        waits for that first. Without a timeout `pending` is awaited as it is: one wake-up when the answer
        comes. A caller that is cancelled leaves the execution to the worker (`_Abandoned`).
        """
        timeout = self.request_timeout_s
        if timeout:
            for older_id in [i for i in self._inflight if i < req_id]:
                entry = self._inflight.get(older_id)
                if entry is not None:
                    either: set[asyncio.Future[Any]] = {entry[0], pending}
                    await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            if not pending.done():
                await asyncio.wait({pending}, timeout=timeout)
                if not pending.done():
                    self._hung(f"no answer within request_timeout_s={timeout:g}")
        return await pending

    def _not_running(self) -> WorkerDied:
        return WorkerDied(f"model '{self.model.name}' version {self.model.version}: worker is not running")

    def _write_inputs(self, buf: memoryview, tensors: Tensors[T]) -> tuple[p.Piece, ...]:
        """Write the inputs into the seat's input region (`buf`); the pieces left in a mapped arena instead
        are returned, for the worker to read there."""
        buf[0] = 0  # wanted (see `_watch`)
        pieces = tensors.write(buf, self.arenas.place if self.arenas.mapped else None)
        self.arenas.in_place_bytes += sum(piece.nbytes for piece in pieces)
        return pieces

    def _send(
        self,
        msg: p.Infer,
        chain: Chain,
        deadline: float | None,
        waiting: Sequence[asyncio.Future[Any]],
        loop: asyncio.AbstractEventLoop,
    ) -> asyncio.Future[object]:
        """Send the execution to the worker; returns what its answer settles."""
        assert self._transport is not None
        # Settled by the answer, the worker's death, or (past the deadline, not started) DeadlineExceeded.
        pending: asyncio.Future[object] = loop.create_future()
        self._inflight[msg.req_id] = (pending, msg.seat)
        if self.calls.handler is not None:  # a model that may call others: calls may come from this one
            self.calls.begin(msg.req_id, self.model, chain, deadline, waiting)
        self._transport.write(encode(msg))
        return pending

    def _expiry(self, pending: asyncio.Future[object]) -> Callable[[], None]:
        """What answers `pending` once the deadline passed before the worker started the execution."""
        model = self.model

        def expire() -> None:
            if not pending.done():
                pending.set_exception(
                    DeadlineExceeded(
                        f"model '{model.name}' version {model.version}: the request was past its deadline "
                        "before its worker started it (it waited behind the execution before it); it was "
                        "not run"
                    )
                )

        return expire

    def _abandon(self, req_id: int, buf: memoryview, cause: BaseException) -> _Abandoned:
        """Nobody will take the answer: the worker skips the execution if it has not started it, and the
        seat is freed when it answers."""
        with contextlib.suppress(ValueError):  # the regions were released (the worker died)
            if buf[0] == 0:
                buf[0] = p.ABANDONED_CANCELLED
        self._abandoned.add(req_id)
        return _Abandoned(cause)

    def _results(
        self,
        reply: object,
        req_id: int,
        regions: Seat,
        tensors: Tensors[T],
        timings: PhaseTimes,
        write_ns: int,
        streamed: bool,
        loop: asyncio.AbstractEventLoop,
    ) -> T:
        """The execution's results, read out of the seat's output region, and its phases in `timings`."""
        if isinstance(reply, p.InferFailed):
            raise error_from_code(reply.code, reply.message)
        if not isinstance(reply, p.InferDone) or reply.req_id != req_id:
            raise Internal(f"protocol error: unexpected reply {type(reply).__name__} from worker")
        timings.worker_span = reply.span
        if streamed:  # a stream's end: its parts went to `on_part`, the end carries no outputs
            timings.worker_wait_ns = reply.waited_ns
            timings.compute_infer_ns = reply.compute_infer_ns
            return cast(T, None)
        if regions.output is None:  # released: the worker died right after answering
            raise self._not_running()
        if regions.named:  # a region is new: the worker has mapped it now
            regions.mapped_by_worker()
        out = regions.output_region()  # the worker may have asked for a larger one meanwhile
        r0 = loop.time()
        results = tensors.read(reply.outputs, out.buf)
        take_phases(timings, reply, write_ns, int((loop.time() - r0) * 1e9))
        return results


def region_ref(region: Region) -> p.RegionRef:
    return p.RegionRef(region.name, region.size)


def take_phases(timings: PhaseTimes, reply: p.InferDone, write_ns: int, read_ns: int) -> None:
    """An execution's phases from its worker's answer, with the daemon's own writing and reading."""
    timings.worker_wait_ns = reply.waited_ns
    timings.compute_input_ns = write_ns + reply.compute_input_ns
    timings.compute_infer_ns = reply.compute_infer_ns
    timings.compute_output_ns = reply.compute_output_ns + read_ns
    timings.device_compute_ns = reply.device_compute_ns


def watch(
    control: memoryview,
    waiting: Sequence[asyncio.Future[Any]],
    deadline: float | None,
    loop: asyncio.AbstractEventLoop,
    expired: Callable[[], None] | None = None,
) -> Callable[[], None]:
    """Mark the execution abandoned in its control block (byte 0 of its input region) once every future in
    `waiting` is done (its callers went away) or the deadline passes; returns what stops watching. The worker
    skips an abandoned execution it has not started, so a request cancelled or expired while the previous
    batch runs does not run after all. When the deadline passes before the worker marked the execution
    started, `expired` is called: the caller answers at once instead of waiting for the execution ahead of
    it to end."""

    def mark(why: int) -> bool:
        with contextlib.suppress(ValueError):  # the regions were released (the worker died)
            if control[0] == 0:
                control[0] = why
                return True
        return False

    def check(_: object = None) -> None:
        if waiting and all(f.done() for f in waiting):
            mark(p.ABANDONED_CANCELLED)

    def expire() -> None:
        if mark(p.ABANDONED_EXPIRED) and expired is not None:
            expired()

    for future in waiting:
        future.add_done_callback(check)
    timer = loop.call_later(max(0.0, deadline - time.monotonic()), expire) if deadline is not None else None

    def unwatch() -> None:
        for future in waiting:
            future.remove_done_callback(check)
        if timer is not None:
            timer.cancel()

    return unwatch
