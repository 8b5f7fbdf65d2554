"""`grpc.health.v1.Health`, answered from the registry at the moment of each call.

Check computes the status from the same predicates as KServe's ServerLive/ServerReady/ModelReady, so the
two protocols agree at every moment instead of through a cache refreshed now and then. Watch re-evaluates
whenever the daemon reports a lifecycle event, and once a second as a safety net (a change of readiness
that no event announced still reaches the watcher), and ends once shutdown starts: the stock servicer keeps
watches open, and an open watch would hold the gRPC drain for its whole timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mpsd.daemon.core.registry import Registry
from mpsd.logs.events import Event, EventBus

SERVING: int = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING: int = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN: int = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
INFERENCE_SERVICE = "inference.GRPCInferenceService"

# Event kinds that may follow a change of readiness (stdout, memory snapshots and requests never do).
LIFECYCLE_KINDS = frozenset({"worker", "crash", "device", "load", "reload", "daemon"})

# How often a Watch re-evaluates when no event woke it.
WATCH_RECHECK_S = 1.0

StatusOf = Callable[[str], "int | None"]


def registry_status(
    registry: Registry, shutting_down: Callable[[], bool], live_services: set[str]
) -> StatusOf:
    """Status of a service name: "" and `live_services` are liveness, the inference service is server
    readiness, a model name is that model's availability (ready, or loaded by its next request); None for
    names the daemon does not know."""

    def status(service: str) -> int | None:
        if service == "" or service in live_services:
            ok = True
        elif service == INFERENCE_SERVICE:
            ok = registry.server_ready()
        elif service in registry.entries:
            ok = registry.model_available(service)
        else:
            return None
        return SERVING if ok and not shutting_down() else NOT_SERVING

    return status


class HealthService(health_pb2_grpc.HealthServicer):  # type: ignore[misc]
    def __init__(self, status_of: StatusOf) -> None:
        self._status_of = status_of
        self._closing = False
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = 0

    def status(self, service: str) -> int | None:
        status = self._status_of(service)
        if status is not None and self._closing:
            return NOT_SERVING
        return status

    def changed(self) -> None:
        """Wake every Watch to re-evaluate. Safe from any thread (log events arrive from anywhere)."""
        loop = self._loop
        if loop is None:  # no Watch has run yet: nobody to wake
            return
        if threading.get_ident() == self._thread:
            self._wake_all()
        elif not loop.is_closed():
            loop.call_soon_threadsafe(self._wake_all)

    def _wake_all(self) -> None:
        woken, self._wake = self._wake, asyncio.Event()
        woken.set()

    def close(self) -> None:
        """Shutdown: every service reads NOT_SERVING from now on, and every Watch ends after saying so."""
        self._closing = True
        self.changed()

    def follow(self, bus: EventBus) -> Callable[[], None]:
        """Re-evaluate watches on every lifecycle event of `bus`; returns the function that stops it."""

        def on_event(event: Event) -> None:
            if event.kind in LIFECYCLE_KINDS:
                self.changed()

        return bus.add_listener(on_event)

    async def Check(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        status = self.status(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service '{request.service}'")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: Any, context: grpc.aio.ServicerContext) -> None:
        if self._loop is None:
            self._loop, self._thread = asyncio.get_running_loop(), threading.get_ident()
        last: int | None = None
        while True:
            # Both taken before reading the status, so no change can slip in between: a shutdown that comes
            # while the write below is in flight wakes this loop once more, to write NOT_SERVING first.
            wake, closing = self._wake, self._closing
            status = self.status(request.service)
            current = SERVICE_UNKNOWN if status is None else status
            if current != last:
                await context.write(health_pb2.HealthCheckResponse(status=current))
                last = current
            if closing:
                return
            with contextlib.suppress(asyncio.TimeoutError):  # 3.10: not yet the builtin TimeoutError
                await asyncio.wait_for(wake.wait(), WATCH_RECHECK_S)
