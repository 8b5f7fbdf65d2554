"""While an instance runs one execution, the next batch it takes is a full one: a short batch past its
queue delay waits (gathering requests) until the running execution ends. A unit test of the queue; the
instance's side (waking the queue when an execution ends) runs in every batching test through the daemon."""

from __future__ import annotations

import asyncio
import time

from mpsd.config.model_config import ModelConfig
from mpsd.daemon.dataplane.queue import Pending, RequestQueue
from mpsd.daemon.dataplane.request import InferRequest, InputTensor

CONFIG = {
    "max_batch_size": 4,
    "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [4]}],
    "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [4]}],
    "dynamic_batching": {"max_queue_delay_microseconds": 1000, "preferred_batch_size": [4]},
}


def pending() -> Pending:
    """A request that has waited a second already: far past the queue delay."""
    request = InferRequest("m", "1", "", (InputTensor("x", "FP32", (1, 4), bytes(16)),), ("y",), 1)
    return Pending(request, asyncio.get_running_loop().create_future(), time.perf_counter_ns() - 10**9)


async def turns(n: int = 20) -> None:
    """Let the event loop run other tasks `n` times (no time passes)."""
    for _ in range(n):
        await asyncio.sleep(0)


def test_a_short_batch_waits_while_the_instance_is_busy_and_a_full_one_goes() -> None:
    async def scenario() -> None:
        queue = RequestQueue(ModelConfig.model_validate(CONFIG), "m")
        busy = True
        for _ in range(2):
            queue.put(pending())
        taking = asyncio.create_task(queue.next_batch(lambda: not busy))
        await turns()
        assert not taking.done(), "a short batch went while the instance was busy"
        for _ in range(2):
            queue.put(pending())  # now 4 rows: a full batch
        assert len(await asyncio.wait_for(taking, 5)) == 4

        queue.put(pending())
        taking = asyncio.create_task(queue.next_batch(lambda: not busy))
        await turns()
        assert not taking.done()
        busy = False
        queue.wake()  # the running execution ended
        assert len(await asyncio.wait_for(taking, 5)) == 1

    asyncio.run(scenario())


def test_without_a_running_execution_a_short_batch_goes_after_its_delay() -> None:
    async def scenario() -> None:
        queue = RequestQueue(ModelConfig.model_validate(CONFIG), "m")
        queue.put(pending())
        assert len(await asyncio.wait_for(queue.next_batch(lambda: True), 5)) == 1
        queue.put(pending())
        assert len(await asyncio.wait_for(queue.next_batch(), 5)) == 1

    asyncio.run(scenario())
