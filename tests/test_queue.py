"""The waiting a request does before it runs, in one process on virtual time: in its version's queue (the
queue delay, max_batch_size, preferred_batch_size, the queue's timeout and the client's deadline) and in
its worker's second seat, behind the execution that runs (the deadline). No daemon, no worker process.

The event loop's clock is virtual (`VirtualLoop`): where the loop would sleep until its next timer, time
jumps there at once. Each promise is checked at the virtual moment it is kept (a batch goes at its delay
to the microsecond, a request is answered at its timeout) and each test runs in milliseconds of real time.
Through the real daemon: test_batching; a busy instance's hold on short batches and settling:
test_batch_hold, test_settle.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import selectors
import socket
import time
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Any, TypeVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpsd.config.model_config import ModelConfig
from mpsd.daemon.dataplane.alarms import SWEEP_AFTER, Alarms
from mpsd.daemon.dataplane.channel import Channel
from mpsd.daemon.dataplane.plane import VersionPlane
from mpsd.daemon.dataplane.queue import Pending, RequestQueue
from mpsd.daemon.dataplane.request import InferRequest, InputTensor, Timings
from mpsd.daemon.dataplane.tensors import Place
from mpsd.daemon.supervise.worker.liveness import Liveness
from mpsd.daemon.supervise.worker.process import WorkerLaunch
from mpsd.errors import DeadlineExceeded, ErrorCode, MpsdError
from mpsd.ipc import protocol as p
from mpsd.ipc.framing import FrameProtocol, encode
from mpsd.net import gather
from mpsd.net.gather import GatheringSelector
from mpsd.net.settle import settled

T = TypeVar("T")

LIMIT_S = 86_400.0  # virtual: a scenario still waiting after a day waits for something that never comes
HOUR_US = 3_600_000_000


# ---- virtual time ------------------------------------------------------------------------------------------


class VirtualSelector(selectors.DefaultSelector):
    """Polls the loop's sockets but never sleeps: where the loop would wait for its next timer, the
    virtual clock moves to it. Nothing else can happen meanwhile (every socket's other end is this
    process's), so the order of events is the one real time would give, without the waiting."""

    def __init__(self) -> None:
        super().__init__()
        self.now_ns = 10**12  # an arbitrary origin, far from 0

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        events = super().select(0)
        if events or (timeout is not None and timeout <= 0):
            return events
        if timeout is None:
            raise AssertionError("nothing left to happen: every task waits for what never comes")
        self.now_ns += max(1, math.ceil(timeout * 1e9))
        return events


class VirtualLoop(asyncio.SelectorEventLoop):
    """An event loop on `VirtualSelector`'s clock: timers, `asyncio.sleep` and timeouts take no real time."""

    def __init__(self) -> None:
        self.clock = VirtualSelector()
        super().__init__(self.clock)

    def time(self) -> float:
        return self.clock.now_ns / 1e9

    def time_ns(self) -> int:
        return self.clock.now_ns


def run(scenario: Callable[[VirtualLoop], Awaitable[T]]) -> T:
    """Run `scenario` on a fresh virtual loop; one still waiting a day (virtual) in fails the test."""
    loop = VirtualLoop()

    async def bounded() -> T:
        return await asyncio.wait_for(scenario(loop), LIMIT_S)

    async def cancel_the_rest() -> None:
        left = asyncio.all_tasks() - {asyncio.current_task()}
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)
        await asyncio.sleep(0)  # closed transports let go of their sockets

    try:
        return loop.run_until_complete(bounded())
    finally:
        loop.run_until_complete(cancel_the_rest())
        loop.close()


async def turns(n: int = 20) -> None:
    """Let the loop run what is ready `n` times over (no time passes)."""
    for _ in range(n):
        await asyncio.sleep(0)


# ---- the queue ---------------------------------------------------------------------------------------------


def model_config(max_batch_size: int = 8, **batching: object) -> ModelConfig:
    """A model batching up to `max_batch_size` rows, with `batching` as its dynamic_batching."""
    return ModelConfig.model_validate(
        {
            "max_batch_size": max_batch_size,
            "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [-1]}],
            "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [-1]}],
            "dynamic_batching": batching,
        }
    )


def queue_on(
    loop: VirtualLoop,
    max_batch_size: int = 8,
    settle: Callable[[], Awaitable[None]] = settled,
    **batching: object,
) -> RequestQueue:
    """The queue of `model_config(max_batch_size, **batching)`, on the loop's virtual clock."""
    config = model_config(max_batch_size, **batching)
    return RequestQueue(config, "'m' version 1", settle, clock=loop.time, clock_ns=loop.time_ns)


def request(rows: int = 1, width: int = 4) -> InferRequest:
    """`rows` rows of `width` values: requests of equal width can share a batch."""
    data = bytes(4 * rows * width)
    return InferRequest("m", "1", "", (InputTensor("x", "FP32", (rows, width), data),), ("y",), rows)


def pending(loop: VirtualLoop, rows: int = 1, width: int = 4, deadline: float | None = None) -> Pending:
    """A request arriving now, as `VersionPlane.infer` makes it (`deadline` is the client's)."""
    return Pending(request(rows, width), loop.create_future(), loop.time_ns(), deadline)


@pytest.mark.parametrize("inputs", [1, 2])
def test_requests_share_a_batch_key_only_with_equal_parameters(inputs: int) -> None:
    """With one input or several, the parameters a model reads are part of the key (tests/test_request_
    parameters.py through the daemon)."""

    def keyed(width: int, parameters: tuple[tuple[str, bool | int | float | str], ...]) -> Hashable:
        base = request(1, width)
        tensors = base.inputs * inputs
        made = dataclasses.replace(base, inputs=tensors, parameters=parameters)
        return Pending(made, None, 0).key  # type: ignore[arg-type]

    assert keyed(4, (("k", 1),)) == keyed(4, (("k", 1),))
    assert keyed(4, (("k", 1),)) != keyed(4, (("k", 2),))
    assert keyed(4, (("k", 1),)) != keyed(4, ())
    assert keyed(4, ()) != keyed(5, ())


def rows_of(batch: Sequence[Pending]) -> list[int]:
    return [item.request.batch_size for item in batch]


async def drain(queue: RequestQueue) -> list[list[Pending]]:
    """Every batch the queue forms, in order, until it is empty (each one taken by a free instance)."""
    batches = []
    while len(queue):
        batches.append(await queue.next_batch())
    return batches


async def expired_at(loop: VirtualLoop, item: Pending) -> int:
    """The virtual time at which `item` was answered DEADLINE_EXCEEDED (anything else fails the test)."""
    with pytest.raises(DeadlineExceeded) as raised:
        await item.future
    assert raised.value.code is ErrorCode.DEADLINE_EXCEEDED
    assert "deadline" in raised.value.message and "not run" in raised.value.message
    return loop.time_ns()


async def rejected_at(loop: VirtualLoop, item: Pending) -> int:
    """The virtual time at which `item` was answered Triton's UNAVAILABLE for a queue policy's timeout."""
    with pytest.raises(MpsdError) as raised:
        await item.future
    assert (raised.value.code, raised.value.message) == (ErrorCode.UNAVAILABLE, "Request timeout expired")
    return loop.time_ns()


# The queue delay --------------------------------------------------------------------------------------------


def test_a_short_batch_goes_when_its_oldest_request_has_waited_the_queue_delay_and_not_before() -> None:
    """A later arrival that leaves the batch short neither releases it nor restarts the delay."""

    async def scenario(loop: VirtualLoop) -> None:
        queue = queue_on(loop, max_queue_delay_microseconds=1000)
        t0 = loop.time_ns()
        first = pending(loop)
        queue.put(first)
        taking = asyncio.create_task(queue.next_batch())
        await asyncio.sleep(0.0004)
        assert not taking.done()
        second = pending(loop)
        queue.put(second)
        batch = await taking
        waited = loop.time_ns() - t0
        assert 1_000_000 <= waited < 1_001_000, waited  # the delay, to the microsecond
        assert batch == [first, second]

    run(scenario)


def test_the_delay_is_over_for_a_request_that_has_already_waited_it() -> None:
    """A request that waited the delay while no instance looked (every one busy) goes as soon as one does."""

    async def scenario(loop: VirtualLoop) -> None:
        queue = queue_on(loop, max_queue_delay_microseconds=1000)
        item = pending(loop)
        queue.put(item)
        await asyncio.sleep(0.002)
        t1 = loop.time_ns()
        assert await queue.next_batch() == [item]
        assert loop.time_ns() == t1

    run(scenario)


def test_a_full_batch_goes_at_once_whatever_the_delay() -> None:
    async def scenario(loop: VirtualLoop) -> None:
        queue = queue_on(loop, max_queue_delay_microseconds=HOUR_US)
        t0 = loop.time_ns()
        items = [pending(loop, 3), pending(loop, 5)]
        for item in items:
            queue.put(item)
        assert await queue.next_batch() == items
        assert loop.time_ns() == t0
        assert queue.last_batch_full  # a lane may let its loop gather while it runs full batches
        short = pending(loop, 3)
        queue.put(short)
        assert await queue.next_batch() == [short]  # after the delay
        assert not queue.last_batch_full

    run(scenario)


def test_a_batch_goes_once_it_reaches_the_preferred_size() -> None:
    """preferred_batch_size ends the wait: 3 rows wait (an hour's delay), the 4th releases them at once."""

    async def scenario(loop: VirtualLoop) -> None:
        queue = queue_on(loop, max_queue_delay_microseconds=HOUR_US, preferred_batch_size=[4])
        items = [pending(loop), pending(loop, 2)]
        for item in items:
            queue.put(item)
        taking = asyncio.create_task(queue.next_batch())
        await asyncio.sleep(60)
        assert not taking.done()
        t1 = loop.time_ns()
        items.append(pending(loop))
        queue.put(items[-1])
        assert await taking == items
        assert loop.time_ns() == t1

    run(scenario)


def test_a_preferred_size_beyond_max_batch_size_is_capped_at_it() -> None:
    async def scenario(loop: VirtualLoop) -> None:
        queue = queue_on(loop, max_queue_delay_microseconds=HOUR_US, preferred_batch_size=[16])
        items = [pending(loop, 4), pending(loop, 4), pending(loop)]
        for item in items:
            queue.put(item)
        t0 = loop.time_ns()
        assert await queue.next_batch() == items[:2]  # 8 rows: full, the one left over waits
        assert loop.time_ns() == t0
        assert await queue.next_batch() == items[2:]
        assert loop.time_ns() - t0 >= HOUR_US * 1000

    run(scenario)


# max_batch_size ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("max_rows", "rows", "batches"),
    [
        (8, [8], [[8]]),
        (8, [4, 4], [[4, 4]]),  # exactly max_batch_size rows fit
        (8, [4, 4, 1], [[4, 4], [1]]),  # one more does not
        (8, [3, 3, 3], [[3, 3], [3]]),
        (8, [5, 4, 3], [[5, 3], [4]]),  # a later request that fits joins; the one that does not waits
        (8, [1] * 9, [[1] * 8, [1]]),
        (1, [1, 1], [[1], [1]]),
    ],
)
def test_a_batch_holds_at_most_max_batch_size_rows(
    max_rows: int, rows: list[int], batches: list[list[int]]
) -> None:
    async def scenario(loop: VirtualLoop) -> list[list[int]]:
        queue = queue_on(loop, max_rows)
        for n in rows:
            queue.put(pending(loop, n))
        return [rows_of(batch) for batch in await drain(queue)]

    assert run(scenario) == batches


def test_a_gathered_batch_holds_at_most_max_batch_size_rows() -> None:
    """A request that skipped the queue for a free instance gathers arrivals up to max_batch_size rows."""

    async def scenario(loop: VirtualLoop) -> None:
        queue: RequestQueue
        late = [pending(loop, n) for n in (3, 2, 3, 2, 1)]
        arriving = list(late)

        async def settle() -> None:  # they arrive while the loop settles (the first time)
            while arriving:
                queue.put(arriving.pop(0))

        queue = queue_on(loop, settle=settle)
        first = pending(loop)
        # 1 + 3 + 2 + 2: exactly max_batch_size rows; the 3 in between would have made 9
        assert await queue.gather([first]) == [first, late[0], late[1], late[3]]
        assert queue.last_batch_full, "a direct execution's batch counts as the queue's"
        assert await queue.next_batch() == [late[2], late[4]]
        assert not queue.last_batch_full
        queue.last_batch_full = True
        alone = pending(loop)
        assert await queue.gather([alone]) == [alone]  # nothing arrives while it settles now
        assert not queue.last_batch_full

    run(scenario)


def expected_batches(requests: Sequence[tuple[int, int]], max_rows: int) -> list[list[int]]:
    """What the queue promises, as indices into `requests` ((rows, width) each): each batch is the oldest
    request left, then every later one of its width that still fits under max_rows, in arrival order."""
    left = list(range(len(requests)))
    batches = []
    while left:
        head, *rest = left
        batch, rows = [head], requests[head][0]
        for i in rest:
            if requests[i][1] == requests[head][1] and rows + requests[i][0] <= max_rows:
                batch.append(i)
                rows += requests[i][0]
        batches.append(batch)
        left = [i for i in left if i not in batch]
    return batches


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    max_rows=st.integers(1, 8),
    delay_us=st.sampled_from([0, 100, HOUR_US]),
    preferred=st.lists(st.integers(1, 16), max_size=2),
)
def test_batches_never_exceed_max_rows_nor_split_lose_or_reorder_requests(
    data: st.DataObject, max_rows: int, delay_us: int, preferred: list[int]
) -> None:
    """Requests of random rows and two shapes, queued while every instance is busy, then taken batch by
    batch."""
    requests = data.draw(
        st.lists(st.tuples(st.integers(1, max_rows), st.sampled_from([2, 3])), min_size=1, max_size=24)
    )

    async def scenario(loop: VirtualLoop) -> tuple[list[Pending], list[list[Pending]]]:
        queue = queue_on(
            loop, max_rows, max_queue_delay_microseconds=delay_us, preferred_batch_size=preferred
        )
        items = [pending(loop, rows, width) for rows, width in requests]
        for item in items:
            queue.put(item)
        return items, await drain(queue)

    items, batches = run(scenario)
    index = {id(item): i for i, item in enumerate(items)}
    got = [[index[id(item)] for item in batch] for batch in batches]
    for batch in got:
        assert sum(requests[i][0] for i in batch) <= max_rows, got
        assert len({requests[i][1] for i in batch}) == 1, got  # never two shapes in one batch
        assert batch == sorted(batch), got  # arrival order within a batch
    assert sorted(i for batch in got for i in batch) == list(range(len(items)))  # each exactly once
    assert got == expected_batches(requests, max_rows)


# Timeouts and deadlines in the queue ------------------------------------------------------------------------


def test_a_queued_request_is_answered_at_its_default_timeout_while_no_instance_takes_work() -> None:
    """default_timeout_microseconds: every instance is busy (nobody calls `next_batch`); the request is
    answered Triton's UNAVAILABLE at its timeout, not when an instance frees up, and leaves the queue."""

    async def scenario(loop: VirtualLoop) -> None:
        queue = queue_on(loop, default_timeout_microseconds=100_000)
        t0 = loop.time_ns()
        item = pending(loop)
        queue.put(item)
        waited = await rejected_at(loop, item) - t0
        assert 100_000_000 <= waited < 100_001_000, waited
        assert len(queue) == 0

    run(scenario)


@pytest.mark.parametrize(
    ("client_s", "default_us", "expected_ms", "answer"),
    [(0.05, 0, 50, expired_at), (0.05, 100_000, 50, expired_at), (0.2, 100_000, 100, rejected_at)],
)
def test_a_queued_request_is_answered_at_the_earlier_of_its_clients_deadline_and_the_default_timeout(
    client_s: float,
    default_us: int,
    expected_ms: int,
    answer: Callable[[VirtualLoop, Pending], Awaitable[int]],
) -> None:
    """The client's deadline is answered DEADLINE_EXCEEDED, the queue policy's timeout as Triton does."""

    async def scenario(loop: VirtualLoop) -> None:
        queue = queue_on(loop, default_timeout_microseconds=default_us)
        t0 = loop.time_ns()
        item = pending(loop, deadline=loop.time() + client_s)
        queue.put(item)
        waited = await answer(loop, item) - t0
        assert expected_ms * 1_000_000 <= waited < expected_ms * 1_000_000 + 1000, waited
        assert len(queue) == 0

    run(scenario)


def test_a_request_past_its_deadline_is_never_in_a_batch() -> None:
    """A batch given back to the queue (its worker went away before running it) with a request now past
    its deadline: the next batch leaves that request out, even before its timer has run, and it is
    answered DEADLINE_EXCEEDED instead of being run."""

    async def scenario(loop: VirtualLoop) -> None:
        queue = queue_on(loop)
        late, patient = pending(loop, 4, deadline=loop.time() + 0.01), pending(loop, 4)
        queue.put(late)
        queue.put(patient)
        batch = await queue.next_batch()  # full: taken at once
        assert batch == [late, patient]
        await asyncio.sleep(0.02)  # the instance's worker dies before it runs the batch
        taking = asyncio.create_task(queue.next_batch())  # another instance's dispatcher
        await turns()
        queue.requeue(batch)
        assert await taking == [patient]
        await expired_at(loop, late)

    run(scenario)


# Priority levels and their queue policies -----------------------------------------------------------------


def at_level(loop: VirtualLoop, priority: int, width: int = 4, timeout_us: int = 0, id: str = "") -> Pending:
    """A one-row request arriving now with the `priority` (and `timeout`) parameter."""
    made = dataclasses.replace(request(1, width), priority=priority, timeout_us=timeout_us, id=id)
    return Pending(made, loop.create_future(), loop.time_ns())


def levels_queue(loop: VirtualLoop, max_batch_size: int = 1, **batching: object) -> RequestQueue:
    """Two priority levels, the second the default."""
    return queue_on(loop, max_batch_size, priority_levels=2, default_priority_level=2, **batching)


def test_a_higher_level_is_always_taken_first_and_each_level_in_arrival_order() -> None:
    """Low-priority requests wait behind a stream of high-priority ones, each high one arriving while the
    batch before it runs; priority 0 and a priority past priority_levels are the default level (Triton's
    rule), and a batch that has room takes the higher level's requests before the lower's."""

    async def scenario(loop: VirtualLoop) -> None:
        queue = levels_queue(loop)
        low = [at_level(loop, p) for p in (7, 0, 2)]  # all three on level 2, the default
        for item in low:
            queue.put(item)
        taken = []
        for _ in range(4):  # a stream of level-1 requests: each is there when the next batch is formed
            high = at_level(loop, 1)
            queue.put(high)
            batch = await queue.next_batch()
            assert batch == [high]
            taken.append(batch)
        assert await drain(queue) == [[item] for item in low]

        batching = levels_queue(loop, max_batch_size=4)
        first, second = at_level(loop, 2), at_level(loop, 2)
        urgent = at_level(loop, 1)
        for item in (first, second, urgent):
            batching.put(item)
        assert await batching.next_batch() == [urgent, first, second]

    run(scenario)


def test_priority_is_ignored_by_a_model_without_levels() -> None:
    async def scenario(loop: VirtualLoop) -> None:
        queue = queue_on(loop, 1)
        items = [at_level(loop, p) for p in (3, 1, 2)]
        for item in items:
            queue.put(item)
        assert await drain(queue) == [[item] for item in items]

    run(scenario)


def test_each_levels_max_queue_size_refuses_with_tritons_error() -> None:
    """Level 1 holds one request, level 2 (the default policy's) two; a full level refuses at once with
    Triton's UNAVAILABLE and words, the other still takes requests; a request that leaves frees its place."""

    async def scenario(loop: VirtualLoop) -> None:
        queue = levels_queue(
            loop,
            default_queue_policy={"max_queue_size": 2},
            priority_queue_policy={1: {"max_queue_size": 1}},
        )
        high = at_level(loop, 1)
        queue.put(high)
        with pytest.raises(MpsdError) as raised:
            queue.put(at_level(loop, 1, id="r7"))
        assert (raised.value.code, raised.value.message) == (
            ErrorCode.UNAVAILABLE,
            "[request id: r7] Exceeds maximum queue size",
        )
        queue.put(at_level(loop, 2))
        queue.put(at_level(loop, 0))
        with pytest.raises(MpsdError) as raised:
            queue.put(at_level(loop, 2))
        assert raised.value.message == "[request id: <id_unknown>] Exceeds maximum queue size"
        assert await queue.next_batch() == [high]
        queue.put(at_level(loop, 1))  # its place is free again
        assert len(queue) == 3

    run(scenario)


def test_a_reject_timeout_fails_a_queued_request_of_its_level_with_tritons_error() -> None:
    """Level 1 REJECTs after 100 ms, level 2 has no timeout: nobody takes work; the level-1 request is
    answered UNAVAILABLE 'Request timeout expired' at 100 ms and leaves the queue, the other stays."""

    async def scenario(loop: VirtualLoop) -> None:
        queue = levels_queue(
            loop,
            priority_queue_policy={1: {"timeout_action": "REJECT", "default_timeout_microseconds": 100_000}},
        )
        t0 = loop.time_ns()
        high, low = at_level(loop, 1), at_level(loop, 2)
        queue.put(high)
        queue.put(low)
        waited = await rejected_at(loop, high) - t0
        assert 100_000_000 <= waited < 100_001_000, waited
        assert not low.future.done()
        assert await drain(queue) == [[low]]

    run(scenario)


def test_a_delay_timeout_moves_a_request_behind_its_levels_others_but_ahead_of_lower_levels() -> None:
    """Level 1 DELAYs after 100 ms: the request that waited longer is not failed but is taken after the
    level-1 request that arrived later, and still before level 2's (Triton's delayed queue is its level's)."""

    async def scenario(loop: VirtualLoop) -> None:
        queue = levels_queue(
            loop,
            priority_queue_policy={1: {"timeout_action": "DELAY", "default_timeout_microseconds": 100_000}},
        )
        old, low = at_level(loop, 1), at_level(loop, 2)
        queue.put(old)
        queue.put(low)
        await asyncio.sleep(0.15)
        assert not old.future.done()
        new = at_level(loop, 1)
        queue.put(new)
        assert await drain(queue) == [[new], [old], [low]]

    run(scenario)


def test_a_delayed_request_is_moved_back_even_before_its_timer_runs() -> None:
    """A batch formed once the timeout has passed by the queue's clock, its timer not run yet (the queue's
    clock is ahead of the loop's here): the expired request is behind, not in front."""

    async def scenario(loop: VirtualLoop) -> None:
        ahead = [0.0]
        policy = {"timeout_action": "DELAY", "default_timeout_microseconds": 1000}
        config = model_config(1, default_queue_policy=policy)
        queue = RequestQueue(config, "'m' version 1", clock=lambda: loop.time() + ahead[0])
        old = at_level(loop, 0)
        queue.put(old)
        ahead[0] = 0.01
        new = at_level(loop, 0)
        queue.put(new)
        assert await drain(queue) == [[new], [old]]

    run(scenario)


@pytest.mark.parametrize(
    ("allow", "action", "timeout_us", "expected_ms"),
    [
        (True, "REJECT", 100_000, 100),  # shorter than the level's: it applies
        (True, "REJECT", 5_000_000, 1000),  # longer: the level's applies (a request may only shorten it)
        (False, "REJECT", 100_000, 1000),  # not allowed: the level's applies
        (True, "DELAY", 100_000, 100),
        (False, "DELAY", 100_000, 1000),
    ],
)
def test_a_requests_timeout_overrides_its_levels_only_where_allowed(
    allow: bool, action: str, timeout_us: int, expected_ms: int
) -> None:
    """Under REJECT the request is answered at the timeout in effect; under DELAY it is still first just
    before it and behind the later request of its level just after it."""

    async def scenario(loop: VirtualLoop) -> None:
        policy = {
            "timeout_action": action,
            "default_timeout_microseconds": 1_000_000,
            "allow_timeout_override": allow,
        }
        queue = levels_queue(loop, priority_queue_policy={1: policy})
        t0 = loop.time_ns()
        item = at_level(loop, 1, timeout_us=timeout_us)
        queue.put(item)
        if action == "REJECT":
            waited = await rejected_at(loop, item) - t0
            assert expected_ms * 1_000_000 <= waited < expected_ms * 1_000_000 + 1000, waited
            return
        queue.put(at_level(loop, 1))
        await asyncio.sleep(expected_ms / 1000 - 0.001)
        assert await queue.next_batch() == [item]  # not moved yet
        item = at_level(loop, 1, timeout_us=timeout_us)
        queue.put(item)
        await asyncio.sleep(0.0005)  # the later request's own timeout (the level's) ends after `item`'s
        later = at_level(loop, 1)
        queue.put(later)
        await asyncio.sleep(expected_ms / 1000 - 0.0003)
        order = [batch[0] for batch in await drain(queue)]
        assert order.index(later) < order.index(item)  # moved behind `later`
        assert not item.future.done()

    run(scenario)


# ---- the worker's second seat ------------------------------------------------------------------------------

LAUNCH = WorkerLaunch(p.ModelSpec("m", 1, "torchscript", "/nowhere", 8, (), ()), 0, "KIND_CPU", None, {})


class Tensors:
    """An execution's tensors as the channel sees them: no input bytes, `name` as its result."""

    refs: tuple[p.TensorRef, ...] = ()
    sequence: tuple[tuple[int, bool], ...] = ()

    def __init__(self, name: str) -> None:
        self.name = name

    def lay_out(self) -> int:
        return p.CONTROL_BYTES

    def write(self, buf: memoryview, place: Place | None) -> tuple[p.Piece, ...]:
        return ()

    def outputs(self) -> tuple[str, ...]:
        return ("y",)

    def parameters(self) -> tuple[tuple[str, bool | int | float | str], ...]:
        return ()

    def read(self, refs: Sequence[p.TensorRef], buf: memoryview) -> str:
        return self.name


class Worker:
    """The worker's end of the channel's socket, played by the test: it takes the Infer frames, marks an
    execution started in its control block (as `worker/serve.py` does) and answers when told."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.executions: list[p.Infer] = []
        self._arrived = asyncio.Event()
        self._transport: asyncio.Transport | None = None

    async def connect(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_unix_connection(
            lambda: FrameProtocol(self._on_message, lambda exc: None), sock=sock
        )
        self._transport = transport

    def _on_message(self, msg: object) -> None:
        if isinstance(msg, p.Infer):
            self.executions.append(msg)
            self._arrived.set()

    async def received(self, n: int) -> p.Infer:
        """The `n`-th execution sent to the worker, once it has arrived."""
        while len(self.executions) < n:
            self._arrived.clear()
            await self._arrived.wait()
        return self.executions[n - 1]

    def control(self, execution: p.Infer) -> int:
        region = self.channel.seats[execution.seat].input
        assert region is not None
        return region.buf[0]

    def start(self, execution: p.Infer) -> None:
        region = self.channel.seats[execution.seat].input
        assert region is not None and region.buf[0] == 0
        region.buf[0] = p.STARTED

    def answer(self, msg: p.InferDone | p.InferFailed) -> None:
        assert self._transport is not None
        self._transport.write(encode(msg))

    def done(self, execution: p.Infer) -> None:
        self.answer(p.InferDone(execution.req_id, (), 0, 0, 0))

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


async def connected() -> tuple[Channel, Worker]:
    """A channel to a worker played by the test, over a socketpair."""
    liveness = Liveness(LAUNCH, 0.0, lambda reason: None)
    channel = Channel(LAUNCH.model, liveness, 0.0, lambda reason: None)
    daemon_end, worker_end = socket.socketpair()
    await channel.connect(daemon_end, lambda: None)
    worker = Worker(channel)
    await worker.connect(worker_end)
    return channel, worker


def execution(
    loop: VirtualLoop, channel: Channel, name: str, deadline: float | None
) -> tuple[asyncio.Task[str], asyncio.Future[Any]]:
    """`name` sent to the worker, for one request (its future) with `deadline` (time.monotonic())."""
    waiting: asyncio.Future[Any] = loop.create_future()
    task = asyncio.create_task(channel.infer_batch(Tensors(name), Timings(), [waiting], deadline))
    return task, waiting


class LastingBacklog:
    backlogged = True
    eases_at = math.inf  # no answer due


def test_a_workers_answer_ends_a_gathering_wait_at_once() -> None:
    """On a loop that gathers while a backlog lasts (`gather_us`), the channel's socket wakes the loop at
    once: the batch behind an answer waits on it. Here the wait is 30 s and the backlog lasts throughout."""

    async def main() -> int:
        selector = asyncio.get_running_loop()._selector  # type: ignore[attr-defined]
        assert isinstance(selector, GatheringSelector)
        selector.watch_backlog(LastingBacklog())
        channel, worker = await connected()
        assert worker._transport is not None  # the test's end of the socket wakes the loop too
        selector.wake_at_once(worker._transport.get_extra_info("socket").fileno())
        try:
            task = asyncio.create_task(channel.infer_batch(Tensors("one"), Timings(), [], None))
            running = await worker.received(1)
            worker.start(running)
            cut_short = selector.cut_short
            worker.done(running)
            assert await task == "one"
            return selector.cut_short - cut_short
        finally:
            worker.close()
            channel.close()

    assert gather.run(main(), 0.0, 30.0) >= 1


def test_a_batch_waiting_in_the_second_seat_is_answered_at_its_deadline_while_the_first_runs() -> None:
    """The worker runs one execution; the next waits in the worker's socket, in the second seat. At its
    deadline it is answered DEADLINE_EXCEEDED at once, while the first still runs, and marked expired for
    the worker, which skips it; its seat is taken until the worker says so."""

    async def scenario(loop: VirtualLoop) -> None:
        channel, worker = await connected()
        try:
            first, _ = execution(loop, channel, "first", None)
            running = await worker.received(1)
            worker.start(running)
            # The channel takes deadlines in time.monotonic(); only the loop's clock is virtual.
            second, _ = execution(loop, channel, "second", time.monotonic() + 60)
            waiting = await worker.received(2)
            assert waiting.seat != running.seat
            await asyncio.sleep(30)
            assert not second.done() and worker.control(waiting) == 0
            with pytest.raises(DeadlineExceeded, match="past its deadline before its worker started it"):
                await second
            assert not first.done()  # answered at its deadline, not once the batch ahead has run
            assert worker.control(waiting) == p.ABANDONED_EXPIRED

            third, _ = execution(loop, channel, "third", None)
            await turns()
            assert len(worker.executions) == 2  # both seats still taken: the worker has not answered
            worker.answer(p.InferFailed(waiting.req_id, "DEADLINE_EXCEEDED", "skipped"))
            worker.start(await worker.received(3))  # into the seat the skipped execution had
            worker.done(running)
            assert await first == "first"
            worker.done(worker.executions[2])
            assert await third == "third"
        finally:
            worker.close()
            channel.close()

    run(scenario)


def test_an_execution_the_worker_has_started_runs_to_its_end_past_its_deadline() -> None:
    """The deadline bounds the wait for the worker, as Triton's timeout does: once started, it finishes."""

    async def scenario(loop: VirtualLoop) -> None:
        channel, worker = await connected()
        try:
            task, _ = execution(loop, channel, "late", time.monotonic() + 1)
            worker.start(await worker.received(1))
            await asyncio.sleep(10)
            assert not task.done()
            worker.done(worker.executions[0])
            assert await task == "late"
        finally:
            worker.close()
            channel.close()

    run(scenario)


class RecordingWorker:
    """A worker handle that records the deadline each execution is sent with."""

    launch = LAUNCH
    pid = 1

    def __init__(self) -> None:
        self.deadlines: list[float | None] = []

    async def infer_batch(
        self,
        tensors: object,
        timings: object,
        waiting: Sequence[asyncio.Future[Any]],
        deadline: float | None,
        on_part: object,
        chain: object = frozenset(),
    ) -> list[tuple[()]]:
        self.deadlines.append(deadline)
        return [()] * len(waiting)


@pytest.mark.parametrize(
    ("deadlines", "sent"), [([5.0, 9.0, 7.0], 9.0), ([5.0, None], None), ([None, None], None)]
)
def test_a_batch_is_sent_with_the_latest_deadline_of_its_requests(
    deadlines: list[float | None], sent: float | None
) -> None:
    """The execution is skipped only once every request in it is past its deadline; one request without a
    deadline keeps it."""

    async def scenario(loop: VirtualLoop) -> list[float | None]:
        plane = VersionPlane("m", 1, model_config())
        worker = RecordingWorker()
        batch = [pending(loop, deadline=d) for d in deadlines]
        await plane.execute(batch, worker)  # type: ignore[arg-type]
        assert all(item.future.done() and not item.future.exception() for item in batch)
        return worker.deadlines

    assert run(scenario) == [sent]


def test_a_scenario_that_waits_for_ever_fails_at_the_limit() -> None:
    """What a broken promise looks like here: the wait for it ends at the virtual limit, at once."""

    async def scenario(loop: VirtualLoop) -> None:
        await loop.create_future()

    with pytest.raises(asyncio.TimeoutError):
        run(scenario)


# ---- the queue's alarms ------------------------------------------------------------------------------------


def test_one_timer_of_the_loops_stands_for_every_queued_deadline() -> None:
    """A hundred requests queued with deadlines arm one timer of the loop's, not one each (each deadline
    later than the one before, as with clients that all wait as long); each is still answered at its own
    deadline, in deadline order, and a request taken before its deadline never is."""

    async def scenario(loop: VirtualLoop) -> None:
        armed = 0
        call_later = loop.call_later

        def counting(*args: Any, **kwargs: Any) -> asyncio.TimerHandle:
            nonlocal armed
            armed += 1
            return call_later(*args, **kwargs)

        loop.call_later = counting  # type: ignore[method-assign]
        queue = queue_on(loop, max_batch_size=1)
        start = loop.time()
        items = [pending(loop, deadline=start + 1 + i / 1000) for i in range(100)]
        for item in items:
            queue.put(item)
        assert armed == 1
        taken = await queue.next_batch()  # the first in
        answered: list[int] = []
        for i, item in enumerate(items[1:], 1):
            item.future.add_done_callback(lambda _, i=i: answered.append(i))
        await asyncio.sleep(1.2)
        assert answered == list(range(1, 100))  # the earliest deadline first
        assert all(isinstance(item.future.exception(), DeadlineExceeded) for item in items[1:])
        assert taken == [items[0]] and not items[0].future.done()

    run(scenario)


def test_alarms_ring_in_order_once_and_cancelled_ones_are_swept() -> None:
    async def scenario(loop: VirtualLoop) -> None:
        rung: list[str] = []
        alarms: Alarms[str] = Alarms(lambda item, moves: rung.append(item), loop.time)
        at = loop.time() + 1
        for name in "abc":
            alarms.set(at, name)
        alarms.set(at, "d").cancel()
        await asyncio.sleep(1)
        assert rung == ["a", "b", "c"]  # equal moments in the order they were set; "d" never
        later = [alarms.set(loop.time() + 60, str(i)) for i in range(1000)]
        for alarm in later:
            alarm.cancel()
        alarms.set(loop.time() + 60, "kept")
        assert len(alarms) <= 2 * SWEEP_AFTER  # the cancelled ones do not pile up until their moment
        await asyncio.sleep(61)
        assert rung == ["a", "b", "c", "kept"]

    run(scenario)
