"""One execution on a worker's channel, from taking a slot to reading the results out of it.

The channel (`channel.py`) owns the socket, the worker's messages and its profiles; what happens to one
batch on it is here, in named steps: take one of the worker's `SLOTS` slots, write the inputs into the
slot's input region, send the Infer frame, wait for the answer (or the request timeout, or a stream's
parts), mark an execution nobody waits for any more abandoned, and read the results. `Channel` inherits
these methods, so a request pays for no extra object or lookup on its way.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar, cast

from mpsd.daemon.dataplane.arenas import WorkerArenas
from mpsd.daemon.dataplane.calls import CallRouter, Chain
from mpsd.daemon.dataplane.slot_regions import SlotRegions
from mpsd.daemon.dataplane.slot_regions import ref as region_ref
from mpsd.daemon.dataplane.tensors import PhaseTimes, Tensors, take_phases
from mpsd.daemon.dataplane.watch import watch as _watch
from mpsd.errors import DeadlineExceeded, Internal, WorkerDied, error_from_code
from mpsd.ipc import protocol as p
from mpsd.ipc.framing import encode

T = TypeVar("T")


class _Abandoned(Exception):
    """The caller stopped waiting (cancelled, or the deadline passed) before the worker answered: the
    execution's slot stays taken until it does."""

    def __init__(self, cause: BaseException) -> None:
        self.cause = cause


class Executions:
    """The executions in flight on one worker's channel: up to `p.SLOTS` at a time, each with its own input
    and output regions, so the next batch can wait in the worker's socket while the current one runs."""

    # The channel's, set by `Channel.__init__`.
    model: p.ModelSpec
    refusing: bool
    request_timeout_s: float
    arenas: WorkerArenas
    calls: CallRouter
    _transport: asyncio.Transport | None
    _hung: Callable[[str], None]

    def __init__(self) -> None:
        self._req_ids = itertools.count(1)
        self.slots = tuple(SlotRegions() for _ in range(p.SLOTS))
        self._free_slots = list(range(p.SLOTS))[::-1]
        self._slot_freed = asyncio.Event()
        self._inflight: dict[int, tuple[asyncio.Future[object], int]] = {}  # req_id -> (answer, slot)
        self._abandoned: set[int] = set()  # executions nobody waits for: their slot is freed on the answer
        self._parts: dict[int, asyncio.Queue[p.StreamPart]] = {}  # req_id -> a stream's parts not yet read

    async def _take_slot(self) -> int:
        while not self._free_slots:
            self._slot_freed.clear()
            await self._slot_freed.wait()
        return self._free_slots.pop()

    def _give_slot(self, slot: int) -> None:
        self._free_slots.append(slot)
        self._slot_freed.set()

    async def infer_batch(
        self,
        tensors: Tensors[T],
        timings: PhaseTimes,
        waiting: Sequence[asyncio.Future[Any]] = (),
        deadline: float | None = None,
        on_part: Callable[[T], Awaitable[bool]] | None = None,
        chain: Chain = frozenset(),
    ) -> T:
        """Run one execution: `tensors` writes its inputs straight into the slot's shared memory and reads
        its results out of it; `timings` gets the phases (the daemon's own writing and reading included).

        Takes one of the worker's slots for the execution; with both in use it waits for one to free up.
        Once every future in `waiting` is done (the callers went away) or `deadline` (time.monotonic(), the
        latest of the requests') has passed, an execution the worker has not started yet is skipped.
        """
        slot = await self._take_slot()
        kept = False  # the worker still uses the slot after this call ends: it is freed when it answers
        try:
            return await self._run_in_slot(slot, tensors, timings, waiting, deadline, on_part, chain)
        except _Abandoned as abandoned:
            kept = True
            raise abandoned.cause from None
        finally:
            if not kept:
                self._give_slot(slot)

    async def _run_in_slot(
        self,
        slot: int,
        tensors: Tensors[T],
        timings: PhaseTimes,
        waiting: Sequence[asyncio.Future[Any]],
        deadline: float | None,
        on_part: Callable[[T], Awaitable[bool]] | None = None,
        chain: Chain = frozenset(),
    ) -> T:
        """Write, send, wait, read: the steps of one execution in `slot`."""
        if self.refusing or self._transport is None:
            raise self._not_running()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        regions = self.slots[slot]
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
            slot,
            time.monotonic_ns(),
            max(1, len(waiting)),
            pieces,
            tensors.parameters(),
            tensors.sequence,  # a sequence model's slots, else ()
            timings.trace,
        )
        pending = self._send(msg, chain, deadline, waiting, loop)
        unwatch = _watch(buf, waiting, deadline, loop, self._expiry(pending))
        try:
            if on_part is None:
                reply = await self._wait_reply(req_id, pending)
            else:
                reply = await self._stream_parts(req_id, pending, tensors, slot, on_part)
        except BaseException as exc:
            if req_id in self._inflight:  # no answer yet: the worker may still use the slot
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
        slot: int,
        on_part: Callable[[T], Awaitable[bool]],
    ) -> object:
        """A decoupled model's request: each part is read out of the slot's output region, handed to
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
                    regions = self.slots[slot]
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
        """Write the inputs into the slot's input region (`buf`); the pieces left in a mapped arena instead
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
        self._inflight[msg.req_id] = (pending, msg.slot)
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
        slot is freed when it answers."""
        with contextlib.suppress(ValueError):  # the regions were released (the worker died)
            if buf[0] == 0:
                buf[0] = p.ABANDONED_CANCELLED
        self._abandoned.add(req_id)
        return _Abandoned(cause)

    def _results(
        self,
        reply: object,
        req_id: int,
        regions: SlotRegions,
        tensors: Tensors[T],
        timings: PhaseTimes,
        write_ns: int,
        streamed: bool,
        loop: asyncio.AbstractEventLoop,
    ) -> T:
        """The execution's results, read out of the slot's output region, and its phases in `timings`."""
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
        regions.mapped_by_worker()
        out = regions.output_region()  # the worker may have asked for a larger one meanwhile
        r0 = loop.time()
        results = tensors.read(reply.outputs, out.buf)
        take_phases(timings, reply, write_ns, int((loop.time() - r0) * 1e9))
        return results
