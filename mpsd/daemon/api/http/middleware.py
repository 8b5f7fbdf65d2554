"""What every HTTP request goes through around its handler: the drain, access control, and errors.

- Once shutdown has begun, readiness is answered 503 at once while other requests are still served for
  the shutdown grace (`shutdown_grace_s`); then every request but liveness is answered 503, while the
  requests already in progress finish: a load balancer stops sending before anything is refused, and
  before the port closes.
- Each route stands for a KServe RPC, whose access category (`net.auth`) decides with the `Authorization:
  Bearer` header, exactly as on gRPC: the request is refused before its body is read, and before a client
  that sent `Expect: 100-continue` is told to send it. A route the policy lets a request without
  credentials take (every one but the operator-only ones, while no tokens are configured) is let through
  without a check: the set of them is made whenever the policy is.
- An MpsdError becomes its HTTP status (`net.status`, the one table) with Triton's `{"error": "..."}` body;
  aiohttp's own refusals (404, 405, 413) get the same body; anything else is a logged 500. Under the
  prefix of another adapter mounted on the server (`api.web.Mount`), that adapter words the error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence

import structlog
from aiohttp import web
from aiohttp.typedefs import Handler

from mpsd.daemon.api.web import ErrorWriter, Mount, method_of
from mpsd.errors import MpsdError, Unauthenticated, Unavailable
from mpsd.net.auth import METHOD_CATEGORY, AccessPolicy
from mpsd.net.status import http_status

from .responses import error_response

LIVE = "/v2/health/live"

log = structlog.get_logger("mpsd.daemon.http")

KSERVE = "/inference.GRPCInferenceService/"
# The RPCs that say no from the stop signal on
READINESS = frozenset({KSERVE + "ServerReady", KSERVE + "ModelReady"})


def triton_error(
    status: int, message: str, error: MpsdError | None, headers: Mapping[str, str] | None
) -> web.Response:
    """Triton's error body, whatever the error."""
    return error_response(status, message, headers)


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
        mounts: Sequence[Mount] = (),
    ) -> None:
        self.policy = policy  # and the methods it leaves open (`_open`)
        self.mounts = tuple(mounts)
        self.limit = limit  # the largest body accepted, in bytes
        self.shutting_down = shutting_down
        self.refusing = refusing if refusing is not None else shutting_down
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def policy(self) -> AccessPolicy:
        return self._policy

    @policy.setter
    def policy(self, policy: AccessPolicy) -> None:
        self._policy = policy
        # What it lets a request without credentials do, it lets every request do: no check per request.
        self._open = frozenset(m for m in METHOD_CATEGORY if policy.check(m, None) is None)

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
        method = method_of(request.match_info.handler)
        readiness = method in READINESS
        # live stays true while in-flight work ends; readiness says no from the signal, the rest after grace
        if request.path != LIVE and (self.refusing() or (readiness and self.shutting_down())):
            raise Unavailable("the daemon is shutting down")
        if method is not None and method not in self._open:
            credentials = [("authorization", v) for v in request.headers.getall("Authorization", ())]
            refused = self.policy.check(method, credentials)
            if refused is not None:
                log.info("call refused", method=method, code=refused.code.value, reason=refused.message)
                raise refused

    async def expect(self, request: web.Request) -> web.StreamResponse | None:
        """`Expect: 100-continue`: the client waits for a go-ahead before it sends the body, so the request
        is admitted (and its declared size checked) first; a refusal is the final answer, and the body is
        never sent. aiohttp runs this before the middleware, and would otherwise always say continue."""
        errors = self.errors(request)
        try:
            self._admit(request)
        except MpsdError as exc:
            return _error(errors, exc)
        declared = request.content_length
        if declared is not None and declared > self.limit:
            limit = f"the limit is {self.limit} bytes (max_message_bytes)"
            return errors(413, f"the request body is {declared} bytes; {limit}", None, None)
        expect = request.headers.get("Expect", "")
        if expect.lower() != "100-continue":
            unknown = f"unknown Expect: {expect[:100]!a} (only 100-continue is understood)"
            return errors(417, unknown, None, None)
        if request.version >= (1, 1):
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0  # what was written is no part of the response
        return None

    def errors(self, request: web.Request) -> ErrorWriter:
        """Who words an error for this path: the adapter mounted there, else Triton's body."""
        path = request.path
        for mount in self.mounts:
            if path.startswith(mount.prefix):
                return mount.errors
        return triton_error

    async def _handle(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            self._admit(request)
            return await handler(request)
        except MpsdError as exc:
            return _error(self.errors(request), exc)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            message = exc.text if exc.status == 413 and exc.text else exc.reason
            return self.errors(request)(exc.status, message or "", None, _allow(exc))
        except (asyncio.CancelledError, ConnectionError):
            raise
        except Exception as exc:
            log.exception("unexpected error", path=request.path)
            return self.errors(request)(500, f"{type(exc).__name__}: {exc}", None, None)


def _error(errors: ErrorWriter, exc: MpsdError) -> web.Response:
    extra = {"WWW-Authenticate": "Bearer"} if isinstance(exc, Unauthenticated) else None
    return errors(http_status(exc), exc.message, exc, extra)


def _allow(exc: web.HTTPException) -> dict[str, str] | None:
    allow = exc.headers.get("Allow")
    return {"Allow": allow} if allow else None
