"""Every way into the daemon: the public gRPC server (or the front processes sharing its port, and the
daemon's private server on a Unix socket that they relay to), HTTP/REST and OpenAI's API, built from the
daemon config, with the one access policy they all enforce, which SIGHUP may replace.

An address the daemon cannot listen on is a ConfigError (`mpsd serve` exits 78 with one line), found before
gRPC tries it.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Sequence
from pathlib import Path

import grpc
import structlog

from mpsd.config.daemon_config import DaemonConfig
from mpsd.config.security import AuthConfig, Token, read_tokens
from mpsd.daemon.api.grpc.admin import AdminServicer
from mpsd.daemon.api.grpc.front_calls import front_calls, front_submit
from mpsd.daemon.api.grpc.gate import Gate
from mpsd.daemon.api.grpc.health import HealthService
from mpsd.daemon.api.grpc.inference import InferenceServicer
from mpsd.daemon.api.grpc.server import grpc_server, services
from mpsd.daemon.api.http.server import HttpEndpoint
from mpsd.daemon.api.metrics import MetricsEndpoint
from mpsd.daemon.api.openai.routes import openai_mount
from mpsd.daemon.api.openai.stats import OpenAIStats
from mpsd.daemon.api.operations import Operations
from mpsd.daemon.supervise.fronts.policy import check_port_free, front_address, front_plan
from mpsd.daemon.supervise.fronts.pool import FrontPool
from mpsd.daemon.supervise.fronts.sockets import make_socket_dir
from mpsd.errors import ConfigError
from mpsd.net.auth import AccessPolicy, build_policy
from mpsd.net.certificates import Certificates, TlsMaterial
from mpsd.net.listen import (
    Address,
    bind,
    connection_age_options,
    http_address,
    openai_address,
    openai_served,
    parse_address,
)

log = structlog.get_logger("mpsd.daemon")


class Ports:
    def __init__(
        self,
        config: DaemonConfig,
        ops: Operations,
        servicer: InferenceServicer,
        health: HealthService,
        admin: AdminServicer,
        metrics: MetricsEndpoint,
    ) -> None:
        self.config = config
        self._ops = ops
        self._servicer = servicer
        self._health = health
        self._admin = admin
        self._metrics = metrics
        # The public one (none with shared-port fronts), and the private one the fronts relay to.
        self.servers: list[grpc.aio.Server] = []
        self.fronts: FrontPool | None = None
        self.http: HttpEndpoint | None = None  # when http_address is set
        self.openai: HttpEndpoint | None = None  # OpenAI's API on a port of its own (openai_address)
        self._gate: Gate | None = None  # access control and decoding for every gRPC call
        self._certificates: Certificates | None = None  # the daemon's own TLS port (none with fronts)
        self._socket_dir: Path | None = None

    def policy(
        self, auth: AuthConfig, tokens: Sequence[Token], address: Address | None = None
    ) -> AccessPolicy:
        """The access policy for `auth` and its tokens (already read) on `address` (the gRPC one)."""
        address = address or parse_address(self.config.grpc_address)
        tls = self.config.tls
        return build_policy(
            auth,
            local_only=address.is_local,
            mutual_tls=tls is not None and tls.client_ca_file is not None,
            address=address.text,
            tokens=tokens,
        )

    def build(self) -> None:
        """The public gRPC server on grpc_address, unless fronts share that port; with fronts, the daemon's
        server on a Unix socket in a private directory, which they relay to; the HTTP endpoint."""
        config = self.config
        limit = config.max_message_bytes
        address = parse_address(config.grpc_address)
        tls = TlsMaterial.read(config.tls) if config.tls is not None else None
        tokens = read_tokens(config.auth)
        gate = self._gate = Gate(
            self.policy(config.auth, tokens), services(self._servicer, self._health, self._admin).handlers
        )
        plan = front_plan(config)

        def server(public: bool) -> grpc.aio.Server:
            options = [
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
                ("grpc.so_reuseport", 0),
                # only on the public port: the fronts' connections to the private socket stay
                *(self._connection_age() if public else []),
            ]
            return grpc_server(gate, options)

        if not plan.shared:
            public = server(public=True)
            self._certificates = Certificates(tls) if tls is not None else None
            _listen(public, address, self._certificates)
            self.servers.append(public)
        if plan.count:
            for port in plan.ports or (address.port,):
                _check_free(front_address(address, port))
            self._socket_dir = make_socket_dir()
            private = parse_address(f"unix://{self._socket_dir / 'daemon.sock'}")
            private_server = server(public=False)
            bind(private_server, private, None)
            self.servers.append(private_server)
            infer, submit = front_calls(self._servicer), front_submit(self._servicer)
            self.fronts = FrontPool(
                plan.shared, config, private.grpc_target, infer, tokens, tls, plan.ports, submit
            )
            self._metrics.add_fronts(self.fronts)
            self._admin.fronts = self.fronts.describe
        http = http_address(config.http_address)
        own = openai_address(config.openai_address)
        mounts = []
        if openai_served(config.openai_address, http):
            stats = OpenAIStats()
            self._metrics.add_collector(stats)
            mounts.append(openai_mount(self._ops, limit, stats))
        if http is not None:
            policy = self.policy(config.auth, tokens, http)
            self.http = HttpEndpoint(http, self._ops, policy, limit, tls, mounts if own is None else ())
        if own is not None:
            policy = self.policy(config.auth, tokens, own)
            self.openai = HttpEndpoint(
                own, self._ops, policy, limit, tls, mounts, kserve=False, name="openai"
            )

    @property
    def http_endpoints(self) -> list[HttpEndpoint]:
        """The HTTP servers: KServe's (with OpenAI's API beside it), and OpenAI's on a port of its own."""
        return [e for e in (self.http, self.openai) if e is not None]

    def _connection_age(self) -> list[tuple[str, int]]:
        config = self.config
        return connection_age_options(config.max_connection_age_s, config.max_connection_age_grace_s)

    async def stop_servers(self, grace: float) -> None:
        await asyncio.gather(*(server.stop(grace) for server in self.servers))

    def remove_socket_dir(self) -> None:
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)

    def tls(self) -> TlsMaterial | None:
        """The TLS material being served now (by this process's own port, or by the fronts)."""
        if self._certificates is not None:
            return self._certificates.material
        return self.fronts.tls if self.fronts is not None else None

    def reload_access(self, fresh: DaemonConfig, tokens: Sequence[Token], tls: TlsMaterial | None) -> None:
        """Tokens and certificate as the config and their files say now: a rotated token file or a renewed
        certificate takes effect at SIGHUP, here and in every front (certificates at the next handshake)."""
        self.config.auth, self.config.tls = fresh.auth, fresh.tls
        if self._gate is not None:
            self._gate.policy = self.policy(fresh.auth, tokens)
        if self._certificates is not None and tls is not None:
            self._certificates.replace(tls)
        if self.fronts is not None:
            self.fronts.update_access(fresh.auth, tokens, tls)
        for endpoint in self.http_endpoints:
            endpoint.update_access(self.policy(fresh.auth, tokens, endpoint.address), tls)
        log.info("tokens reloaded", tokens=len(tokens))
        if tls is not None:
            log.info("certificates reloaded", client_certificates=tls.mutual)


def _check_free(address: Address) -> None:
    """A port held by another server is the operator's to fix: a ConfigError naming it."""
    try:
        check_port_free(address)
    except OSError as exc:
        raise ConfigError(str(exc)) from None


def _listen(server: grpc.aio.Server, address: Address, certificates: Certificates | None) -> None:
    """Bind the public port; a TCP port is checked first, so its refusal reads as one line of ours."""
    if address.unix_path is None:
        _check_free(address)
    try:
        bind(server, address, certificates)
    except (OSError, RuntimeError) as exc:
        raise ConfigError(f"grpc_address {address.text}: cannot listen: {exc}") from None
