"""The HTTP/REST server's lifecycle on the daemon's own event loop (aiohttp's AppRunner and one site): TCP
or a Unix socket (mode 0600), in the clear or over (mutual) TLS, with the gRPC port's tokens. It serves
KServe's routes, other adapters' mounted beside them (`api.web.Mount`), or those alone on a port of their
own.

A port that cannot be listened on is logged, not fatal: gRPC, which clients of earlier versions use,
keeps serving. At shutdown the port stays open until the requests in progress have finished (or the
drain timeout), answering every new request 503, and only then closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Sequence

import structlog
from aiohttp import web

from mpsd.daemon.api.operations import Operations
from mpsd.daemon.api.status_view import StatusView
from mpsd.daemon.api.web import Mount
from mpsd.daemon.supervise.fronts.policy import check_port_free
from mpsd.errors import ConfigError
from mpsd.net.auth import AccessPolicy
from mpsd.net.certificates import SslContexts, TlsMaterial
from mpsd.net.listen import SOCKET_MODE, Address, prepare_socket_path

from .routes import build_app

log = structlog.get_logger("mpsd.daemon.http")

# Once the drain has waited for the requests in progress, what is left of them (their client is gone, or
# the drain timed out) gets this long before their connections close.
CLOSE_TIMEOUT_S = 1.0


class HttpEndpoint:
    def __init__(
        self,
        address: Address,
        ops: Operations,
        policy: AccessPolicy,
        limit: int,
        tls: TlsMaterial | None = None,
        mounts: Sequence[Mount] = (),
        kserve: bool = True,
        name: str = "http",
    ) -> None:
        self.address = address
        self.name = name  # in its log lines: `http`, or the API it serves alone
        # the status page, with KServe's routes
        self.status = StatusView(ops.registry, ops.server_name) if kserve else None
        self.app, self.admission = build_app(ops, policy, limit, self.status, mounts, kserve)
        self.tls = SslContexts(tls) if tls is not None else None
        self._runner: web.AppRunner | None = None
        self._hurry = asyncio.Event()

    @property
    def url(self) -> str:
        scheme = "https" if self.tls is not None else "http"
        if self.address.unix_path is not None:
            return f"{scheme}+unix://{self.address.unix_path}"
        return f"{scheme}://{self.address.text}"

    async def start(self) -> None:
        runner = web.AppRunner(
            self.app, access_log=None, handler_cancellation=True, shutdown_timeout=CLOSE_TIMEOUT_S
        )
        await runner.setup()
        context = self.tls.context if self.tls is not None else None
        try:
            await self._listen(runner, context)
        except (OSError, ConfigError) as exc:
            await runner.cleanup()
            reason = exc.message if isinstance(exc, ConfigError) else str(exc)
            log.error(f"{self.name} endpoint not started", address=self.address.text, reason=reason)
            return
        self._runner = runner
        if self.status is not None:
            self.status.recent.start()
        log.info(f"{self.name} endpoint listening", url=self.url)

    async def _listen(self, runner: web.AppRunner, context: object) -> None:
        path = self.address.unix_path
        if path is None:
            check_port_free(self.address)  # aiohttp binds with SO_REUSEADDR: on macOS it would not fail
            host = self.address.host or None
            await web.TCPSite(runner, host, self.address.port, ssl_context=context).start()  # type: ignore[arg-type]
            return
        prepare_socket_path(self.address, f"{self.name}_address")
        old_umask = os.umask(0o177)  # covers the moment between bind() and chmod()
        try:
            await web.UnixSite(runner, str(path), ssl_context=context).start()  # type: ignore[arg-type]
        finally:
            os.umask(old_umask)
        os.chmod(path, SOCKET_MODE)

    def update_access(self, policy: AccessPolicy, tls: TlsMaterial | None) -> None:
        """SIGHUP: new tokens for the next request, a renewed certificate for the next handshake."""
        self.admission.policy = policy
        if self.tls is not None and tls is not None:
            self.tls.replace(tls)

    def hurry(self) -> None:
        """A second stop signal: end the drain now."""
        self._hurry.set()

    async def stop(self, drain_timeout_s: float) -> None:
        """Wait (at most `drain_timeout_s`) for the requests in progress, then close the port."""
        runner, self._runner = self._runner, None
        if runner is None:
            return
        if self.status is not None:
            await self.status.recent.stop()
        idle = asyncio.ensure_future(self.admission.idle())
        hurry = asyncio.ensure_future(self._hurry.wait())
        try:
            await asyncio.wait({idle, hurry}, timeout=drain_timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            idle.cancel()
            hurry.cancel()
        if self.admission.in_flight:
            log.warning(
                f"{self.name} requests still in progress at the end of the drain",
                requests=self.admission.in_flight,
            )
        await runner.cleanup()
        if self.address.unix_path is not None:
            with contextlib.suppress(FileNotFoundError):
                self.address.unix_path.unlink()
