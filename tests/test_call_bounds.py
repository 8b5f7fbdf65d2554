"""What bounds a python model's call to another model, in one process (core/calls.py, dataplane/calls.py):
the call's own timeout when it is sooner than its execution's deadline (and only then), and its caller,
which ends only once every request of the execution went away, not the first of a batch."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from mpsd.daemon.core.calls import ModelCalls
from mpsd.daemon.dataplane.calls import Caller, CallLink
from mpsd.errors import Cancelled, ErrorCode
from mpsd.ipc import protocol as p


class NeverLoads:
    """Step models whose every model takes forever to load: a call runs until something bounds it."""

    def __init__(self) -> None:
        self.deadlines: list[float | None] = []

    async def acquire(self, name: str, version: str, deadline: float | None) -> Any:
        self.deadlines.append(deadline)
        await asyncio.get_running_loop().create_future()

    def touch(self, name: str) -> None:
        pass

    def model_available(self, name: str) -> bool:
        return True

    def loads_first(self, name: str) -> bool:
        return True


def _call(timeout_us: int) -> p.Call:
    return p.Call(call_id=1, req_id=1, model="called", version="", inputs=(), timeout_us=timeout_us)


def _failure(timeout_us: int, deadline_in: float | None) -> tuple[p.CallFailed, list[float | None]]:
    """Run one call from an execution whose deadline is `deadline_in` seconds away (None: none)."""

    async def body() -> tuple[p.CallFailed, list[float | None]]:
        models = NeverLoads()
        deadline = None if deadline_in is None else time.monotonic() + deadline_in
        caller = Caller("caller", 1, frozenset(), deadline)
        sent: list[object] = []
        # a bound that is not applied leaves the call running: the test fails on this outer limit
        await asyncio.wait_for(ModelCalls(models)(_call(timeout_us), caller, CallLink(1, sent.append)), 20)
        [answer] = sent
        assert isinstance(answer, p.CallFailed), answer
        return answer, models.deadlines

    return asyncio.run(body())


def test_a_calls_own_timeout_bounds_it_without_a_deadline() -> None:
    failed, [deadline] = _failure(timeout_us=50_000, deadline_in=None)
    assert failed.code == ErrorCode.DEADLINE_EXCEEDED.value
    assert "call to model 'called': its timeout of 50000 us passed" in failed.message, failed.message
    assert deadline is not None  # the model's load is bounded by it too


def test_a_calls_own_timeout_bounds_it_when_sooner_than_the_executions_deadline() -> None:
    failed, [deadline] = _failure(timeout_us=50_000, deadline_in=3600)
    assert failed.code == ErrorCode.DEADLINE_EXCEEDED.value
    assert "its timeout of 50000 us passed" in failed.message, failed.message
    assert deadline is not None and deadline < time.monotonic() + 1800


def test_the_executions_deadline_bounds_a_call_whose_timeout_is_later() -> None:
    failed, [deadline] = _failure(timeout_us=3_600_000_000, deadline_in=0.05)
    assert failed.code == ErrorCode.DEADLINE_EXCEEDED.value
    assert "the deadline of the request to model 'caller' passed" in failed.message, failed.message
    assert deadline is not None and deadline < time.monotonic() + 1800


def test_a_batch_s_calls_go_on_until_every_request_of_it_went_away() -> None:
    async def body() -> None:
        loop = asyncio.get_running_loop()
        clients = [loop.create_future() for _ in range(3)]  # the batch's requests, waited for
        caller = Caller("caller", 1, frozenset(), None, clients)
        clients[0].cancel()
        clients[1].cancel()
        await asyncio.sleep(0)  # the futures' callbacks run
        assert not caller.ended.done()  # one request of the batch still waits for the answer
        clients[2].cancel()
        await asyncio.sleep(0)
        assert caller.ended.done() and isinstance(caller.ended.result(), Cancelled)

    asyncio.run(body())
