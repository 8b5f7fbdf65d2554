"""The daemon's lifecycle: start the gRPC front, load the repository, serve, shut down cleanly.

Signal handlers only set flags and wake the main loop; the loop does the work.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
from collections.abc import Sequence
from pathlib import Path

import grpc
import structlog
from setproctitle import setproctitle

from mpsd.config.daemon_config import DaemonConfig, load_daemon_config
from mpsd.config.security import AuthConfig, Token, read_tokens
from mpsd.daemon.api.admin import SERVICE_NAME as ADMIN_SERVICE
from mpsd.daemon.api.admin import AdminServicer
from mpsd.daemon.api.gate import Gate
from mpsd.daemon.api.grpc_server import grpc_server, services
from mpsd.daemon.api.health import HealthService, registry_status
from mpsd.daemon.api.http.server import HttpEndpoint
from mpsd.daemon.api.inference import InferenceServicer
from mpsd.daemon.api.metrics import MetricsEndpoint
from mpsd.daemon.core.reconcile import Reconciler
from mpsd.daemon.core.registry import Registry
from mpsd.daemon.core.watcher import watch_repository
from mpsd.daemon.sdnotify import SdNotifier
from mpsd.daemon.supervise.fronts.policy import check_port_free, front_address, front_plan
from mpsd.daemon.supervise.fronts.pool import FrontPool
from mpsd.daemon.supervise.fronts.sockets import make_core_dir, remove_stale_core_dirs
from mpsd.daemon.supervise.instance import SupervisorSettings
from mpsd.errors import ConfigError
from mpsd.ipc import shm
from mpsd.logs import set_level
from mpsd.logs.events import BUS
from mpsd.net import eventloop
from mpsd.net.auth import AccessPolicy, build_policy
from mpsd.net.certificates import Certificates, TlsMaterial, check_replacement
from mpsd.net.listen import Address, bind, connection_age_options, http_address, parse_address

log = structlog.get_logger("mpsd.daemon")


class Daemon:
    def __init__(self, config: DaemonConfig, config_path: Path | None = None) -> None:
        self.config = config
        self.config_path = config_path
        settings = SupervisorSettings(
            start_timeout_s=config.worker_start_timeout_s,
            stop_timeout_s=config.worker_stop_timeout_s,
            backoff_initial_s=config.restart_backoff_initial_s,
            backoff_max_s=config.restart_backoff_max_s,
            drain_timeout_s=config.drain_timeout_s,
            request_timeout_s=config.request_timeout_s,
            heartbeat_timeout_s=config.heartbeat_timeout_s,
        )
        self.registry = Registry(
            config.model_repository,
            settings,
            config.drain_timeout_s,
            config.memory_budget_policy,
            config.reload_quiet_period_s,
            config,
        )
        self.registry.allow_symlinks = config.allow_symlinks
        self.registry.op_library_dirs = tuple(config.op_library_dirs)
        self.reconciler = Reconciler(self.registry)
        self.notifier = SdNotifier()
        self.shutting_down = False  # from the stop signal on: health says NOT_SERVING
        self.refusing = False  # from the end of shutdown_grace_s on: new calls are refused
        self._skip_grace = asyncio.Event()
        self.health = HealthService(
            registry_status(self.registry, lambda: self.shutting_down, {ADMIN_SERVICE})
        )
        self.health.follow(BUS)
        self.admin = AdminServicer(self.registry, self.reload)
        self.metrics = MetricsEndpoint(config.metrics_address, self.registry)
        self._stop = asyncio.Event()
        self._hup = asyncio.Event()
        self._servers: list[grpc.aio.Server] = []  # the public one (none with shared-port fronts), the core's
        self._hurry: asyncio.Future[None] | None = None
        self.fronts: FrontPool | None = None
        self._gate: Gate | None = (
            None  # access control and decoding for every gRPC call, made with the server
        )
        self._certificates: Certificates | None = (
            None  # the daemon's own TLS port (none with shared-port fronts)
        )
        self._core_dir: Path | None = None
        self.servicer = InferenceServicer(
            self.registry, lambda: self.shutting_down, config.model_control, lambda: self.refusing
        )
        self.http: HttpEndpoint | None = None  # made with the gRPC server, when http_address is set

    def _policy(
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

    def _build_servers(self) -> list[grpc.aio.Server]:
        """The public gRPC server on grpc_address, unless fronts share that port; with fronts, the core's
        server on a Unix socket in a private directory, which they relay to."""
        limit = self.config.max_message_bytes
        address = parse_address(self.config.grpc_address)
        tls = TlsMaterial.read(self.config.tls) if self.config.tls is not None else None
        tokens = read_tokens(self.config.auth)
        self._gate = Gate(
            self._policy(self.config.auth, tokens), services(self.servicer, self.health, self.admin).handlers
        )
        gate = self._gate
        plan = front_plan(self.config)

        def server(public: bool) -> grpc.aio.Server:
            options = [
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
                ("grpc.so_reuseport", 0),
                # only on the public port: the fronts' connections to the core socket stay
                *(self._connection_age() if public else []),
            ]
            return grpc_server(gate, options)

        servers = []
        if not plan.shared:
            public = server(public=True)
            self._certificates = Certificates(tls) if tls is not None else None
            bind(public, address, self._certificates)
            servers.append(public)
        if plan.count:
            for port in plan.ports or (address.port,):
                check_port_free(front_address(address, port))
            self._core_dir = make_core_dir()
            core = parse_address(f"unix://{self._core_dir / 'core.sock'}")
            core_server = server(public=False)
            bind(core_server, core, None)
            servers.append(core_server)
            infer = self.servicer.infer_serialized_parts
            self.fronts = FrontPool(
                plan.shared, self.config, core.grpc_target, infer, tokens, tls, plan.ports
            )
            self.metrics.add_fronts(self.fronts)
            self.admin.fronts = self.fronts.describe
        http = http_address(self.config.http_address)
        if http is not None:
            policy = self._policy(self.config.auth, tokens, http)
            self.http = HttpEndpoint(http, self.servicer.ops, policy, limit, tls)
        return servers

    def _connection_age(self) -> list[tuple[str, int]]:
        config = self.config
        return connection_age_options(config.max_connection_age_s, config.max_connection_age_grace_s)

    def _remove_core_dir(self) -> None:
        if self._core_dir is not None:
            shutil.rmtree(self._core_dir, ignore_errors=True)

    async def _update_health(self) -> None:
        """Health is computed when asked; this only wakes Watch streams (lifecycle events wake them too,
        this is the safety net) and, at shutdown, turns everything NOT_SERVING and ends them."""
        if self.shutting_down:
            self.health.close()
            return
        self.health.changed()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_stop_signal)
        loop.add_signal_handler(signal.SIGHUP, self._hup.set)
        removed = shm.cleanup_stale()
        if removed:
            log.info("removed stale shared memory", segments=removed)
        stale_dirs = remove_stale_core_dirs()
        if stale_dirs:
            log.info("removed socket directories of dead daemons", directories=stale_dirs)
        try:
            return await self._serve()
        finally:  # whatever failed: no front outlives the daemon, no socket directory stays behind
            if self.fronts is not None:
                await self.fronts.stop(0.0)
            self._remove_core_dir()

    async def _serve(self) -> int:
        self._servers = self._build_servers()
        for server in self._servers:
            await server.start()
        if self.fronts is not None:
            try:
                await self.fronts.start()
            except Exception:
                await asyncio.gather(*(server.stop(0) for server in self._servers))
                raise
        if self.http is not None:
            await self.http.start()
        await self.metrics.start()
        front_ports = list(self.fronts.ports) if self.fronts is not None else []
        log.info(
            "listening",
            address=self.config.grpc_address,
            repository=str(self.config.model_repository),
            event_loop=eventloop.loop_name(),
            busy_poll_us=eventloop.busy_poll_us(),
            **({"front_ports": front_ports} if front_ports else {}),
        )
        await self._update_health()
        background = [asyncio.create_task(self._watchdog())]
        await self.reconciler.run_once(settle=False)
        self.registry.residency.start()
        await self._update_health()
        ready = self.registry.server_ready()
        log.info(
            "ready" if ready else "started with unavailable models",
            models=len(self.registry.entries),
            **({"front_ports": front_ports} if front_ports else {}),
        )
        self.notifier.ready()
        self.notifier.status(self._status_line())
        background.append(asyncio.create_task(self.reconciler.run_forever()))
        mode = self.config.model_control
        if mode in ("watch", "poll"):
            background.append(asyncio.create_task(self._watch(mode)))
        while not self._stop.is_set():
            hup = asyncio.create_task(self._hup.wait())
            stop = asyncio.create_task(self._stop.wait())
            await asyncio.wait({hup, stop}, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
            hup.cancel()
            stop.cancel()
            if self._hup.is_set() and not self._stop.is_set():
                self._hup.clear()
                await self._on_hup()
            await self._update_health()
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        await self._shutdown()
        return 0

    async def _watch(self, mode: str) -> None:
        poll = self.config.poll_interval_s if mode == "poll" else None
        try:
            await watch_repository(
                self.config.model_repository, self.reconciler.wake, self.config.reload_quiet_period_s, poll
            )
        except Exception:
            log.exception("repository watcher stopped; SIGHUP and `mpsd reload` still reconcile")

    async def _on_hup(self) -> None:
        """SIGHUP: re-read what can change at runtime, then reconcile; never a restart."""
        self.notifier.reloading()
        log.info("reload requested (SIGHUP)")
        self._reread_config()
        await self.reconciler.run_once()
        await self._update_health()
        self.notifier.ready()
        self.notifier.status(self._status_line())

    def _reread_config(self) -> None:
        if self.config_path is None:
            return
        try:
            fresh = load_daemon_config(self.config_path)
            # Read once, here: the fronts get these very tokens and certificate bytes.
            tokens = read_tokens(fresh.auth)
            tls = TlsMaterial.read(fresh.tls) if fresh.tls is not None else None
            check_replacement(self._tls(), tls)
        except ConfigError as exc:
            log.error("config not reloaded", reason=exc.message)
            return
        for key in ("log_level", "drain_timeout_s", "memory_budget_policy", "reload_quiet_period_s"):
            setattr(self.config, key, getattr(fresh, key))
        set_level(self.config.log_level)
        self.registry.drain_timeout_s = self.config.drain_timeout_s
        self.registry.budget_policy = self.config.memory_budget_policy
        self.registry.quiet_period_s = self.config.reload_quiet_period_s
        self._reload_access(fresh, tokens, tls)

    def _tls(self) -> TlsMaterial | None:
        """The TLS material being served now (by this process's own port, or by the fronts)."""
        if self._certificates is not None:
            return self._certificates.material
        return self.fronts.tls if self.fronts is not None else None

    def _reload_access(self, fresh: DaemonConfig, tokens: Sequence[Token], tls: TlsMaterial | None) -> None:
        """Tokens and certificate as the config and their files say now: a rotated token file or a renewed
        certificate takes effect at SIGHUP, here and in every front (certificates at the next handshake)."""
        self.config.auth, self.config.tls = fresh.auth, fresh.tls
        if self._gate is not None:
            self._gate.policy = self._policy(fresh.auth, tokens)
        if self._certificates is not None and tls is not None:
            self._certificates.replace(tls)
        if self.fronts is not None:
            self.fronts.update_access(fresh.auth, tokens, tls)
        if self.http is not None:
            self.http.update_access(self._policy(fresh.auth, tokens, self.http.address), tls)
        log.info("tokens reloaded", tokens=len(tokens))
        if tls is not None:
            log.info("certificates reloaded", client_certificates=tls.mutual)

    async def reload(self) -> str:
        """`mpsd reload` and the admin Reload RPC: the same reconcile as SIGHUP, awaited."""
        report = await self.reconciler.run_once()
        await self._update_health()
        return report.summary()

    async def _watchdog(self) -> None:
        """Ping systemd's watchdog from the event loop, so a stuck loop stops the pings."""
        interval = self.notifier.watchdog_interval()
        if interval is None:
            return
        while True:
            self.notifier.watchdog()
            await asyncio.sleep(interval)

    def _status_line(self) -> str:
        rows = self.registry.index()
        ready = sum(1 for r in rows if r.state == "READY")
        return f"{ready} of {len(rows)} model versions ready"

    def _on_stop_signal(self) -> None:
        if self._stop.is_set():
            log.warning("second stop signal: ending the drain now")
            self.config.drain_timeout_s = 0.0
            self._skip_grace.set()
            if not self.refusing:  # still in the grace: the drain, next, now takes no time
                return
            if self.fronts is not None:
                self.fronts.hurry()
            if self.http is not None:
                self.http.hurry()
            if self._servers:
                self._hurry = asyncio.ensure_future(self._stop_servers(0))
            return
        log.info(
            "stopping: health not serving",
            shutdown_grace_s=self.config.shutdown_grace_s,
            drain_timeout_s=self.config.drain_timeout_s,
        )
        self.shutting_down = True
        self._stop.set()

    async def _grace(self) -> None:
        """Health already says NOT_SERVING; new calls are still served for shutdown_grace_s (or until a
        second stop signal), so that balancers and clients that check health stop sending first."""
        grace = self.config.shutdown_grace_s
        if grace <= 0 or self._skip_grace.is_set():
            return
        log.info("health not serving; still serving new calls before the drain", shutdown_grace_s=grace)
        with contextlib.suppress(asyncio.TimeoutError):  # 3.10: not yet the builtin TimeoutError
            await asyncio.wait_for(self._skip_grace.wait(), grace)

    async def _shutdown(self) -> None:
        self.notifier.stopping()
        await self._update_health()
        await self._grace()
        self.refusing = True
        log.info("stopping: draining in-flight requests", drain_timeout_s=self.config.drain_timeout_s)
        self.admin.close()
        drain = self.config.drain_timeout_s
        http = asyncio.ensure_future(self.http.stop(drain)) if self.http is not None else None
        # The public port drains beside the fronts; the core's server (last) after them: it serves them.
        core = self._servers[-1:] if self.fronts is not None else []
        public = asyncio.gather(*(server.stop(drain) for server in self._servers if server not in core))
        if self.fronts is not None:
            await self.fronts.stop(drain)
        await asyncio.gather(public, *(server.stop(drain) for server in core))
        if http is not None:
            await http
        await self.metrics.stop()
        await self.registry.shutdown()
        shm.cleanup_own()
        log.info("stopped")

    async def _stop_servers(self, grace: float) -> None:
        await asyncio.gather(*(server.stop(grace) for server in self._servers))


def serve(config: DaemonConfig, config_path: Path | None = None) -> int:
    eventloop.check(config.event_loop)  # before anything starts; `mpsd serve` checks it with the config
    setproctitle(f"mpsd: daemon {config.grpc_address}")  # named in ps by role and address
    return eventloop.run(Daemon(config, config_path).run(), config.event_loop, config.busy_poll_us)
