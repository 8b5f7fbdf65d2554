"""Settling: wait until the event loop has taken in the work that is already on its way.

With dynamic batching and no queue delay, a request that finds its instance free would run at once, alone.
Where the daemon's loop is the busy part (small requests, many in flight), the requests behind it are
already in the loop: in gRPC's completion queue, in a front link's buffer, in tasks that have not run yet.
Waiting until the loop has run out of ready work costs the request only the time the loop spends taking
those in, and lets them share its execution: one message to the worker and one answer for all of them, and
one wake-up of each process instead of one per request. An idle loop settles at once, in one pass.

The loop's selector sees every pass (`BusyPollSelector.when_settled`), so mpsd's asyncio loops settle
exactly; on another loop (uvloop) a settle is one pass.
"""

from __future__ import annotations

import asyncio

from mpsd.net.busy_poll import BusyPollSelector


async def settled() -> None:
    """Return once the running loop has no ready work left, or after a few passes at most
    (`busy_poll.SETTLE_PASSES`) under a load that keeps it busy."""
    loop = asyncio.get_running_loop()
    selector = getattr(loop, "_selector", None)
    if not isinstance(selector, BusyPollSelector):
        await asyncio.sleep(0)
        return
    waiter: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not waiter.done():  # not cancelled meanwhile
            waiter.set_result(None)

    selector.when_settled(wake)
    await waiter
