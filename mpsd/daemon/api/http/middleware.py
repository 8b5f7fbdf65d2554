"""What every HTTP request goes through around its handler: the drain, access control, and errors.

- Once shutdown has begun, readiness is answered 503 at once while other requests are still served for
  the shutdown grace (`shutdown_grace_s`); then every request but liveness is answered 503, while the
  requests already in progress finish: a load balancer stops sending before anything is refused, and
  before the port closes.
- Each route stands for a KServe RPC, whose access category (`net.auth`) decides with the `Authorization:
  Bearer` header, exactly as on gRPC: the request is refused before its body is read, and before a client
  that sent `Expect: 100-continue` is told to send it.
- An MpsdError becomes its HTTP status (`net.status`, the one table) with Triton's `{"error": "..."}` body;
  aiohttp's own refusals (404, 405, 413) get the same body; anything else is a logged 500.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import structlog
from aiohttp import web
from aiohttp.typedefs import Handler

from mpsd.errors import MpsdError, Unauthenticated, Unavailable
from mpsd.net.auth import AccessPolicy
from mpsd.net.status import http_status

from .responses import error_response

LIVE = "/v2/health/live"
READINESS = frozenset({"ServerReady", "ModelReady"})  # the RPCs that say no from the stop signal on

log = structlog.get_logger("mpsd.daemon.http")

KSERVE = "/inference.GRPCInferenceService/"
RPC_KEY = "mpsd_rpc"  # a route handler's attribute: the RPC it stands for (a KServe name, or a full one)


def rpc_of(handler: Any) -> str | None:
    name = getattr(handler, RPC_KEY, None)
    if name is None:
        return None
    return name if name.startswith("/") else f"{KSERVE}{name}"


class Admission:
    """The middleware, with its state: the access policy (replaced at SIGHUP) and the requests in
    progress."""

    __middleware_version__ = 1  # what aiohttp's `web.middleware` marks: a new-style middleware

    def __init__(
        self,
        policy: AccessPolicy,
        shutting_down: Callable[[], bool],
        limit: int,
        refusing: Callable[[], bool] | None = None,
    ) -> None:
        self.policy = policy
        self.limit = limit  # the largest body accepted, in bytes
        self.shutting_down = shutting_down
        self.refusing = refusing if refusing is not None else shutting_down
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    async def idle(self) -> None:
        """Until no request is in progress."""
        await self._idle.wait()

    async def __call__(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        self.in_flight += 1
        self._idle.clear()
        try:
            return await self._handle(request, handler)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    def _admit(self, request: web.Request) -> None:
        """Raise what refuses the request before anything of its body is read: the drain, access."""
        handler = request.match_info.handler
        readiness = getattr(handler, RPC_KEY, None) in READINESS
        # live stays true while in-flight work ends; readiness says no from the signal, the rest after grace
        if request.path != LIVE and (self.refusing() or (readiness and self.shutting_down())):
            raise Unavailable("the daemon is shutting down")
        method = rpc_of(handler)
        if method is not None:
            credentials = [("authorization", v) for v in request.headers.getall("Authorization", ())]
            refused = self.policy.check(method, credentials)
            if refused is not None:
                log.info("call refused", method=method, code=refused.code.value, reason=refused.message)
                raise refused

    async def expect(self, request: web.Request) -> web.StreamResponse | None:
        """`Expect: 100-continue`: the client waits for a go-ahead before it sends the body, so the request
        is admitted (and its declared size checked) first; a refusal is the final answer, and the body is
        never sent. aiohttp runs this before the middleware, and would otherwise always say continue."""
        try:
            self._admit(request)
        except MpsdError as exc:
            return _error(exc)
        declared = request.content_length
        if declared is not None and declared > self.limit:
            limit = f"the limit is {self.limit} bytes (max_message_bytes)"
            return error_response(413, f"the request body is {declared} bytes; {limit}")
        expect = request.headers.get("Expect", "")
        if expect.lower() != "100-continue":
            return error_response(417, f"unknown Expect: {expect[:100]!a} (only 100-continue is understood)")
        if request.version >= (1, 1):
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0  # what was written is no part of the response
        return None

    async def _handle(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            self._admit(request)
            return await handler(request)
        except MpsdError as exc:
            return _error(exc)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            message = exc.text if exc.status == 413 and exc.text else exc.reason
            return error_response(exc.status, message or "", _allow(exc))
        except (asyncio.CancelledError, ConnectionError):
            raise
        except Exception as exc:
            log.exception("unexpected error", path=request.path)
            return error_response(500, f"{type(exc).__name__}: {exc}")


def _error(exc: MpsdError) -> web.Response:
    extra = {"WWW-Authenticate": "Bearer"} if isinstance(exc, Unauthenticated) else None
    return error_response(http_status(exc), exc.message, extra)


def _allow(exc: web.HTTPException) -> dict[str, str] | None:
    allow = exc.headers.get("Allow")
    return {"Allow": allow} if allow else None
