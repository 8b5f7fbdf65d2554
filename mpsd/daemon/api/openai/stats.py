"""OpenAI requests counted per model, endpoint and HTTP status, for the Prometheus endpoint
(`mpsd_openai_requests_total`), and each failed one logged as a `request` event.

Counting is a dictionary increment per request; the metric families are built only when scraped, as the
daemon's other metrics are. What the model itself did (queue, compute, responses) is in the per-model
metrics every protocol shares.
"""

from __future__ import annotations

import asyncio
import functools
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import structlog
from aiohttp import web
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from mpsd.errors import MpsdError
from mpsd.net.status import http_status

log = structlog.get_logger("mpsd.daemon.openai")

MODEL_KEY = "mpsd_openai_model"  # the request's model, once a handler has read it (request[MODEL_KEY])
CLIENT_GONE = 499  # the client went away before its answer was complete (nginx's convention)

Handler = Callable[[Any, web.Request], Awaitable[web.StreamResponse]]


class OpenAIStats(Collector):
    """The counts, and their metric family."""

    def __init__(self) -> None:
        self.requests: Counter[tuple[str, str, int]] = Counter()

    def count(self, model: str, endpoint: str, status: int) -> None:
        self.requests[(model, endpoint, status)] += 1

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "mpsd_openai_requests",
            "Requests to OpenAI's API, by model, endpoint and HTTP status (499: the client went away).",
            labels=["model", "endpoint", "status"],
        )
        for (model, endpoint, status), n in sorted(self.requests.items()):
            family.add_metric([model, endpoint, str(status)], n)
        yield family


def counted(endpoint: str) -> Callable[[Handler], Handler]:
    """Count each request of a handler method (of an object with `stats`) by how it ended."""

    def wrap(handler: Handler) -> Handler:
        @functools.wraps(handler)
        async def run(self: Any, request: web.Request) -> web.StreamResponse:
            stats: OpenAIStats = self.stats
            try:
                response = await handler(self, request)
            except MpsdError as exc:
                _failed(stats, request, endpoint, int(http_status(exc)), exc.message)
                raise
            except web.HTTPException as exc:
                _failed(stats, request, endpoint, exc.status, exc.text or exc.reason)
                raise
            except (asyncio.CancelledError, ConnectionError):
                stats.count(request.get(MODEL_KEY, ""), endpoint, CLIENT_GONE)
                raise
            stats.count(request.get(MODEL_KEY, ""), endpoint, response.status)
            return response

        return run

    return wrap


def _failed(stats: OpenAIStats, request: web.Request, endpoint: str, status: int, reason: str) -> None:
    model = request.get(MODEL_KEY, "")
    stats.count(model, endpoint, status)
    about = {"model": model} if model else {}
    log.info(
        "openai request failed", endpoint=endpoint, status=status, error=reason, event_kind="request", **about
    )
