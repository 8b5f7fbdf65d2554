"""An execution the worker has answered gives its room back before its requests are answered
(`ModelVersion.execute`'s `release`): where the instance's dispatcher waits for that room, the next batch
goes to the worker first. The instance's side is in tests/test_supervisor.py; this is the version's."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from types import SimpleNamespace
from typing import Any

from mpsd.config.model_config import ModelConfig
from mpsd.daemon.core.batching.queue import Pending
from mpsd.daemon.core.model_version import ModelVersion
from mpsd.daemon.core.request import InferRequest, InputTensor, OutputTensor
from mpsd.daemon.supervise.instance import SupervisorSettings

CONFIG = {
    "max_batch_size": 4,
    "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [1]}],
    "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [1]}],
}


class Worker:
    """Answers every execution at once with one output per request."""

    launch = SimpleNamespace(label="m/1#0")
    pid = 1

    async def infer_batch(self, tensors: Any, timings: Any, waiting: Any, *rest: Any) -> list[Any]:
        return [(OutputTensor("y", "FP32", (1, 1), bytes([k]) * 4),) for k in range(len(waiting))]


def pending() -> Pending:
    request = InferRequest("m", "1", "", (InputTensor("x", "FP32", (1, 1), bytes(4)),), ("y",), 1)
    return Pending(request, asyncio.get_running_loop().create_future(), time.perf_counter_ns())


def run(handed: bool) -> tuple[list[bool], list[bytes]]:
    """Execute a batch of two; returns whether each future was settled when `release`'s awaitable ran (or,
    with nothing handed back, when the loop ran the next callback), and the outputs they got."""

    async def scenario() -> tuple[list[bool], list[bytes]]:
        version = ModelVersion(
            "m", 1, ModelConfig.model_validate(CONFIG), ("", ""), [], [], SupervisorSettings()
        )
        batch = [pending(), pending()]
        seen: list[bool] = []

        async def turns() -> None:
            await asyncio.sleep(0)
            seen.extend(item.future.done() for item in batch)

        def release() -> Awaitable[None] | None:
            if handed:
                return turns()
            # nobody waits for the room: nothing to yield for, so the answers come before any other callback
            asyncio.get_running_loop().call_soon(lambda: seen.extend(item.future.done() for item in batch))
            return None

        await version.execute(batch, Worker(), release)  # type: ignore[arg-type]
        return seen, [item.future.result().outputs[0].data for item in batch]

    return asyncio.run(scenario())


def test_the_requests_are_answered_after_what_release_hands_back() -> None:
    seen, outputs = run(handed=True)
    assert seen == [False, False], "settled before the dispatcher's turns"
    assert outputs == [bytes([0]) * 4, bytes([1]) * 4]


def test_without_a_waiting_dispatcher_the_requests_are_answered_at_once() -> None:
    seen, outputs = run(handed=False)
    assert seen == [True, True], "a lone execution's answers waited for a turn of the loop"
    assert outputs == [bytes([0]) * 4, bytes([1]) * 4]
