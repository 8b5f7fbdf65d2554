"""The data plane through its typed entry (`VersionPlane.infer`), in one process against fake worker
channels: no protobuf, no subprocess. The fake channel runs the real marshalling (`BatchTensors` lays the
batch out, writes it and splits the outputs back) around a model computing y = x + 1.

The direct path (a request that finds its lane idle runs in its caller's task) must give what the plain
path (every request through the queue and a lane's dispatcher) gives: the same answers, the same errors and
the same executions in the same order; so must `VersionPlane.submit` (no task of the caller's, the answer
in a future), with every request counted in the statistics and none left in flight. Property-based:
hypothesis draws the model's batching, the lanes and waves of requests arriving together. Through the real
daemon: test_batching, test_infer.
"""

from __future__ import annotations

import asyncio
import gc
import math
import socket
import time
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from mpsd.config.model_config import ModelConfig
from mpsd.daemon.dataplane.marshal import BatchTensors
from mpsd.daemon.dataplane.plane import VersionPlane
from mpsd.daemon.dataplane.queue import Pending
from mpsd.daemon.dataplane.request import InferRequest, InferResult, InputTensor, Timings
from mpsd.errors import Internal, MpsdError, Unavailable
from mpsd.ipc import protocol as p
from mpsd.net import gather
from mpsd.net.gather import GatheringSelector

POISON = -1  # a request whose first value is this fails its whole execution, as a model's error would


class FakeChannel:
    """A worker's channel that runs y = x + 1 on the batch the data plane laid out, after a few turns of the
    loop (a worker's time); it records each execution's request ids in order."""

    def __init__(self, executions: list[list[str]], label: str) -> None:
        self.refusing = False
        self.overlaps = False
        self.label = label
        self.pid: int | None = None
        self.executions = executions

    async def infer_batch(
        self,
        tensors: BatchTensors,
        timings: Timings,
        waiting: Sequence[asyncio.Future[Any]] = (),
        deadline: float | None = None,
        on_part: Callable[[Any], Awaitable[bool]] | None = None,
        chain: frozenset[tuple[str, int]] = frozenset(),
    ) -> list[tuple[Any, ...]]:
        region = bytearray(tensors.lay_out())
        tensors.write(memoryview(region), None)
        (ref,) = tensors.refs
        self.executions.append([r.id for r in tensors.requests])
        await self.running()
        x = np.frombuffer(region, np.int32, ref.nbytes // 4, ref.offset)
        if POISON in x[:: ref.shape[-1]]:
            raise Internal("m/1: the model failed on a poisoned row")
        y = (x + 1).tobytes()
        return tensors.read((p.TensorRef("y", "INT32", ref.shape, 0, len(y)),), memoryview(y))

    async def running(self) -> None:
        """The model's time in the worker."""
        for _ in range(3):
            await asyncio.sleep(0)


class QueuedOnly(VersionPlane):
    """The plain path: no request runs directly, every one goes through the queue and a dispatcher."""

    def _free_lane(self, item: Pending) -> None:  # type: ignore[override]
        return None


def config(max_batch_size: int, batching: bool) -> ModelConfig:
    spec: dict[str, object] = {
        "max_batch_size": max_batch_size,
        "input": [{"name": "x", "data_type": "TYPE_INT32", "dims": [-1]}],
        "output": [{"name": "y", "data_type": "TYPE_INT32", "dims": [-1]}],
    }
    if batching:
        spec["dynamic_batching"] = {}
    return ModelConfig.model_validate(spec)


def request(rid: str, rows: int, width: int, poisoned: bool) -> InferRequest:
    """`rows` rows of `width` values from the id's number: requests of equal width can share a batch."""
    x = np.arange(rows * width, dtype=np.int32) + 100 * int(rid)
    if poisoned:
        x[0] = POISON
    return InferRequest("m", "1", rid, (InputTensor("x", "INT32", (rows, width), x.tobytes()),), ("y",), rows)


Outcome = tuple[str, tuple[int, ...], bytes] | tuple[str, str]
Wave = list[tuple[int, int, bool, int]]  # each request's rows, width, whether it is poisoned, and its gap


async def arrive(plane: VersionPlane, request: InferRequest, turns: int, submit: bool) -> InferResult:
    """The request, sent after `turns` turns of the loop: through `infer`, or with `submit` through
    `submit`, the caller waiting on its future."""
    for _ in range(turns):
        await asyncio.sleep(0)
    if submit:
        told: list[asyncio.Future[InferResult]] = []
        future = plane.submit(request, then=told.append)
        try:
            return await future
        finally:
            assert told == [future], "`then` runs once, before the caller hears the answer"
    return await plane.infer(request)


async def serve(
    plane: VersionPlane, lanes: int, waves: Sequence[Wave], submit: bool = False
) -> tuple[list[Outcome], list[list[str]]]:
    """Each wave's requests arrive one after another, each its gap of loop turns after the one before (0:
    in the same turn), and the next wave once all are answered: every request's answer (outputs, or the
    error) and the executions. With `submit`, each goes in through `VersionPlane.submit`."""
    executions: list[list[str]] = []
    plane.lanes = [plane.new_lane() for _ in range(lanes)]
    for i, lane in enumerate(plane.lanes):
        lane.attach(FakeChannel(executions, f"m/1#{i}"))  # type: ignore[arg-type]
    plane.closed = None
    done_with = asyncio.Event()
    dispatchers = [
        asyncio.create_task(lane.dispatch(lane.channel, done_with))  # type: ignore[arg-type]
        for lane in plane.lanes
    ]
    outcomes: list[Outcome] = []
    rid = 0
    for wave in waves:
        arrivals = []
        turns = 0
        for rows, width, poisoned, gap in wave:
            turns += gap
            arrivals.append(arrive(plane, request(str(rid), rows, width, poisoned), turns, submit))
            rid += 1
        answers = await asyncio.gather(*arrivals, return_exceptions=True)
        for answer in answers:
            if isinstance(answer, InferResult):
                (y,) = answer.outputs
                outcomes.append(("ok", y.shape, y.data))
            else:
                assert isinstance(answer, MpsdError), answer
                outcomes.append((answer.code.value, answer.message))
    done_with.set()
    for lane in plane.lanes:
        await lane.stop()
    for task in dispatchers:
        task.cancel()
    await asyncio.gather(*dispatchers, return_exceptions=True)
    return outcomes, executions


waves_strategy = st.lists(
    st.lists(
        st.tuples(
            st.integers(1, 3),
            st.sampled_from([2, 3]),
            st.integers(0, 7).map(lambda n: n == 0),
            st.sampled_from([0, 0, 1, 2, 5]),
        ),
        min_size=1,
        max_size=6,
    ),
    min_size=1,
    max_size=4,
)


def expected(waves: list[Wave], executions: list[list[str]], max_rows: int, lanes: int) -> list[Outcome]:
    """What each request must get from the executions it ran in: y = x + 1 of its own rows, or the model's
    error if a poisoned request shared its execution. Each execution holds compatible requests only, at
    most `max_rows` rows, and begins with the oldest compatible request not run yet; with several lanes, one
    of the `lanes` oldest (executions handed to different lanes in a turn of the loop start in either order,
    as they would on their workers)."""
    flat = [r for wave in waves for r in wave]
    execution_of = {rid: tuple(e) for e in executions for rid in e}
    assert sorted(execution_of) == sorted(map(str, range(len(flat)))), "a request ran twice, or never"
    for execution in executions:
        assert len({flat[int(rid)][1] for rid in execution}) == 1, f"widths mixed in {execution}"
        assert sum(flat[int(rid)][0] for rid in execution) <= max_rows, f"over max rows: {execution}"
    ran: set[int] = set()
    for execution in executions:  # each starts with the oldest of its width not run yet, then later ones
        ids = [int(rid) for rid in execution]
        width = flat[ids[0]][1]
        oldest = [i for i, r in enumerate(flat) if r[1] == width and i not in ran][:lanes]
        assert ids[0] in oldest and ids == sorted(ids), f"out of order: {executions}"
        ran.update(ids)
    outcomes: list[Outcome] = []
    for rid, (rows, width, *_) in enumerate(flat):
        if any(flat[int(mate)][2] for mate in execution_of[str(rid)]):
            outcomes.append(("INTERNAL", "m/1: the model failed on a poisoned row"))
        else:
            x = np.arange(rows * width, dtype=np.int32) + 100 * rid
            outcomes.append(("ok", (rows, width), (x + 1).tobytes()))
    return outcomes


@settings(max_examples=60, deadline=None)
@given(
    max_batch_size=st.integers(0, 6), batching=st.booleans(), lanes=st.integers(1, 2), waves=waves_strategy
)
@example(  # the third request goes to a lane in the turn the fourth finds the other idle: 3 starts first
    max_batch_size=0,
    batching=False,
    lanes=2,
    waves=[[(1, 2, True, 0), (1, 2, True, 0), (1, 2, True, 2), (1, 2, True, 1)]],
)
@example(  # submitted in one turn: 0 runs direct in a task of its own, not started yet when 1 and 2 arrive;
    # the lane counts it at once, so 1 and 2 queue, instead of running direct too with 2 (full) ahead of 1
    max_batch_size=2,
    batching=True,
    lanes=1,
    waves=[[(1, 2, True, 0), (1, 2, True, 0), (2, 2, True, 0)]],
)
def test_the_direct_path_gives_the_answers_errors_and_order_the_queue_gives(
    max_batch_size: int, batching: bool, lanes: int, waves: list[Wave]
) -> None:
    """Batches may differ (a request alone in the daemon runs without waiting for others to join it), but
    each request gets what its execution owes it, by the same rules, on both paths."""
    batching = batching and max_batch_size > 0
    model = config(max_batch_size, batching)
    max_rows = max_batch_size if batching else 1
    rows_allowed = max(1, max_batch_size)
    waves = [[(min(rows, rows_allowed), *rest) for rows, *rest in wave] for wave in waves]  # type: ignore[misc]

    def run(plane_type: type[VersionPlane], submit: bool = False) -> list[Outcome]:
        plane = plane_type("m", 1, model)
        outcomes, executions = asyncio.run(asyncio.wait_for(serve(plane, lanes, waves, submit), 10))
        assert outcomes == expected(
            waves, executions, max(max_rows, rows_allowed if not batching else 0), lanes
        )
        assert plane.inflight == 0 and plane.flight.idle.is_set()
        ok = sum(outcome[0] == "ok" for outcome in outcomes)
        assert (plane.stats.success.count, plane.stats.fail.count) == (ok, len(outcomes) - ok)
        return outcomes

    direct, queued, submitted = run(VersionPlane), run(QueuedOnly), run(VersionPlane, submit=True)
    for d, q, s in zip(direct, queued, submitted, strict=True):  # where all ran, all gave the same bytes
        if d[0] == q[0] == s[0] == "ok":
            assert d == q == s


def test_every_answer_is_its_own_requests_rows_whatever_the_batch() -> None:
    """Four requests of two widths, arriving together on a batching model: the compatible ones share an
    execution, and each gets y = x + 1 of its own rows."""

    async def scenario() -> tuple[list[Outcome], list[list[str]]]:
        plane = VersionPlane("m", 1, config(8, batching=True))
        wave = [(2, 3, False, 0), (1, 2, False, 0), (1, 3, False, 0), (3, 3, False, 0)]
        return await serve(plane, 1, [wave])

    outcomes, executions = asyncio.run(scenario())
    assert executions == [["0"], ["1"], ["2", "3"]] or executions == [["0", "2", "3"], ["1"]]
    for rid, (rows, width), outcome in zip("0123", [(2, 3), (1, 2), (1, 3), (3, 3)], outcomes, strict=True):
        x = np.arange(rows * width, dtype=np.int32) + 100 * int(rid)
        assert outcome == ("ok", (rows, width), (x + 1).tobytes())


def test_a_version_that_is_closed_or_has_no_worker_refuses_with_the_reason() -> None:
    async def scenario() -> list[str]:
        plane = VersionPlane("m", 1, config(4, batching=True))
        lane = plane.new_lane()
        plane.lanes = [lane]
        messages = []
        for closed in ("loading", None):
            plane.closed = closed
            with pytest.raises(Unavailable) as refused:
                await plane.infer(request("0", 1, 2, False))
            messages.append(refused.value.message)
        lane.attach(FakeChannel([], "m/1#0"))  # type: ignore[arg-type]
        lane.detach("worker restarting after exit code 1")
        with pytest.raises(Unavailable) as refused:
            await plane.infer(request("0", 1, 2, False))
        messages.append(refused.value.message)
        return messages

    assert asyncio.run(scenario()) == [
        "model 'm' version 1 is not ready (loading)",
        "model 'm' version 1 is not ready",
        "model 'm' version 1 is not ready: worker restarting after exit code 1",
    ]


def test_losing_the_last_worker_answers_the_queued_requests_with_the_reason() -> None:
    async def scenario() -> str:
        plane = VersionPlane("m", 1, config(4, batching=True))
        lane = plane.new_lane()
        plane.lanes = [lane]
        plane.closed = None
        lane.attach(FakeChannel([], "m/1#0"))  # type: ignore[arg-type]
        item = Pending(request("0", 1, 2, False), asyncio.get_running_loop().create_future(), 0)
        plane.queue.put(item)
        lane.detach("worker restarting after killed by signal 9")
        with pytest.raises(Unavailable) as refused:
            await item.future
        return refused.value.message

    assert asyncio.run(scenario()) == (
        "model 'm' version 1 is not ready: worker restarting after killed by signal 9"
    )


def serving() -> tuple[VersionPlane, Any]:
    """A plane whose one lane's channel is attached, and no dispatcher: what is submitted stays queued."""
    plane = QueuedOnly("m", 1, config(4, batching=True))
    lane = plane.new_lane()
    plane.lanes = [lane]
    plane.closed = None
    lane.attach(FakeChannel([], "m/1#0"))  # type: ignore[arg-type]
    return plane, lane


def test_a_submitted_request_is_counted_and_told_in_the_call_that_answers_it() -> None:
    """`submit`'s futures tell their submitter where they are settled, not in a later pass of the loop: a
    batch's answers, a failure of the queue, or the submitter's cancel each leave every submitted request
    counted, out of flight and told when the call returns (no `await` in between)."""

    async def scenario() -> None:
        plane, lane = serving()
        told: list[asyncio.Future[InferResult]] = []
        futures = [plane.submit(request(str(i), 1, 2, False), then=told.append) for i in range(3)]
        assert plane.flight.count == 3 and not told
        futures[0].cancel()
        assert told == futures[:1] and plane.flight.count == 2
        plane.fail_queued(Unavailable("model 'm' version 1 is not ready: unloading"))
        assert told == futures and plane.flight.count == 0
        assert plane.stats.fail.count == 2  # the cancelled one is not counted, as with `infer`
        assert [f.exception().message for f in futures[1:]] == [
            "model 'm' version 1 is not ready: unloading"
        ] * 2  # type: ignore[union-attr]

        batch = [plane.submit(request(str(i), 1, 2, False), then=told.append) for i in range(2)]
        items = plane.queue.take_all()
        await plane.execute(items, lane.channel)  # type: ignore[arg-type]
        assert told[-2:] == batch and plane.flight.count == 0
        assert plane.stats.success.count == 2

    asyncio.run(scenario())


def test_a_failing_then_is_the_loops_to_report_and_the_others_are_still_answered() -> None:
    async def scenario() -> list[Any]:
        loop = asyncio.get_running_loop()
        reported: list[dict[str, Any]] = []
        loop.set_exception_handler(lambda _, context: reported.append(context))
        plane, _ = serving()
        told: list[asyncio.Future[InferResult]] = []

        def broken(_: asyncio.Future[InferResult]) -> None:
            raise RuntimeError("a reply that cannot be written")

        first = plane.submit(request("0", 1, 2, False), then=broken)
        second = plane.submit(request("1", 1, 2, False), then=told.append)
        plane.fail_queued(Unavailable("gone"))
        assert first.done() and told == [second] and plane.flight.count == 0
        return [type(c["exception"]) for c in reported]

    assert asyncio.run(scenario()) == [RuntimeError]


def test_a_told_request_is_freed_without_the_collector() -> None:
    """A submitter holds its request's future (as a front's call does) and the future its `then`: once told,
    the future lets go of `then`, or every request would leave a cycle for the collector."""

    class Caller:
        def __init__(self) -> None:
            self.future: asyncio.Future[InferResult] | None = None

        def then(self, future: asyncio.Future[InferResult]) -> None:
            self.future = future

    async def scenario() -> None:
        plane, _ = serving()
        caller = Caller()
        gone = weakref.ref(plane.submit(request("0", 1, 2, False), then=caller.then))
        plane.fail_queued(Unavailable("model 'm' version 1 is not ready: unloading"))
        assert caller.future is gone()
        del caller
        assert gone() is None, "freed as its last reference went"

    gc.disable()
    try:
        asyncio.run(scenario())
    finally:
        gc.enable()


class FullLanes:
    """A version whose lanes stay full, as the gathering loop hears of one."""

    backlogged = True
    eases_at = math.inf  # no answer due


def test_a_request_a_gathering_wait_held_back_counts_its_time_from_the_waits_start() -> None:
    """While every lane of a version is full the loop gathers, and a request that arrives meanwhile waits in
    its socket. One submitted as its frame is read is stamped with the wait's start, not the moment it is
    read: its queue delay and its latency count the wait, which the daemon chose."""
    hold_s = 0.05

    async def main() -> tuple[int, int, int]:
        loop = asyncio.get_running_loop()
        selector = loop._selector  # type: ignore[attr-defined]
        assert isinstance(selector, GatheringSelector)
        selector.watch_backlog(FullLanes())
        plane, _ = serving()
        front, client = socket.socketpair()
        front.setblocking(False)
        read: asyncio.Future[int] = loop.create_future()

        def take() -> None:  # as a front's link submits what it reads, in the reading callback
            front.recv(1)
            plane.submit(request("0", 1, 2, False))
            read.set_result(time.perf_counter_ns())

        loop.add_reader(front.fileno(), take)
        try:
            sent = time.perf_counter_ns()
            client.send(b"x")
            read_ns = await read
        finally:
            loop.remove_reader(front.fileno())
            front.close()
            client.close()
        (item,) = plane.queue.take_all()
        return sent, item.enqueued_ns, read_ns

    sent, stamped, read = gather.run(main(), 0.0, hold_s)
    assert sent <= stamped, "no earlier than the wait that held it began"
    assert read - stamped >= hold_s * 1e9, "the wait it was held through counts"
