"""The daemon's lifecycle: start the gRPC front, load the repository, serve, shut down cleanly.

Signal handlers only set flags and wake the main loop; the loop does the work.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from pathlib import Path
from typing import Any

import structlog
from setproctitle import setproctitle

from mpsd.config.daemon_config import DaemonConfig, load_daemon_config
from mpsd.config.security import read_tokens
from mpsd.daemon.api.grpc.admin import SERVICE_NAME as ADMIN_SERVICE
from mpsd.daemon.api.grpc.admin import AdminServicer
from mpsd.daemon.api.grpc.health import HealthService, registry_status
from mpsd.daemon.api.grpc.inference import InferenceServicer
from mpsd.daemon.api.metrics import MetricsEndpoint
from mpsd.daemon.api.operations import Operations
from mpsd.daemon.api.tracing import Tracing
from mpsd.daemon.awake import StayAwake
from mpsd.daemon.core.reconcile import Reconciler
from mpsd.daemon.core.registry import Registry
from mpsd.daemon.core.response_cache import ResponseCache
from mpsd.daemon.core.watcher import watch_repository
from mpsd.daemon.open_files import raise_open_files, tell
from mpsd.daemon.ports import Ports
from mpsd.daemon.sdnotify import SdNotifier
from mpsd.daemon.shutdown import (
    EXIT_CLEAN,
    EXIT_CUT_SHORT,
    MARGIN_S,
    SECOND_SIGNAL_S,
    ExitDeadline,
    stop_bound_s,
)
from mpsd.daemon.supervise.fronts.policy import busy_poll_us, front_plan
from mpsd.daemon.supervise.fronts.sockets import remove_stale_socket_dirs
from mpsd.daemon.supervise.instance import SupervisorSettings
from mpsd.errors import ConfigError
from mpsd.ipc import shm
from mpsd.ipc.heap import settle_collector
from mpsd.logs import set_level
from mpsd.logs.events import BUS
from mpsd.net import accept_errors, eventloop
from mpsd.net.certificates import TlsMaterial, check_replacement

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
        # From the end of shutdown_grace_s on, new calls are refused. A flag the adapters read (every HTTP
        # request asks it), rather than a function of this module's: the layers below never call up into it.
        self.refusing = asyncio.Event()
        self._skip_grace = asyncio.Event()
        self.health = HealthService(
            registry_status(self.registry, lambda: self.shutting_down, {ADMIN_SERVICE})
        )
        self.health.follow(BUS)
        self.admin = AdminServicer(self.registry, self.reload)
        self.metrics = MetricsEndpoint(config.metrics_address, self.registry)
        self._stop = asyncio.Event()
        self._hup = asyncio.Event()
        self._started = False  # the first load of the repository has finished
        self.deadline = ExitDeadline(self._remove_files)
        self._hurry: asyncio.Future[None] | None = None
        self._housekeeping: dict[str, tuple[str, list[str]]] = {}  # what dead daemons left, removed at start
        # The one set of operations both protocol adapters translate to: gRPC's servicer and HTTP's routes.
        self.ops = Operations(
            self.registry,
            lambda: self.shutting_down,
            config.model_control,
            refusing=self.refusing.is_set,
            server_name=config.server_name,
            response_cache=ResponseCache(config.response_cache_bytes)
            if config.response_cache_bytes
            else None,
            tracing=Tracing(config.trace),
            stages=self.registry.rollout.stages,
        )
        self.servicer = InferenceServicer(self.ops)
        self.ports = Ports(config, self.ops, self.servicer, self.health, self.admin, self.metrics)
        self.awake = StayAwake(config.prevent_idle_sleep)  # macOS: no idle sleep while it serves

    def _remove_files(self) -> None:
        """What would outlive a daemon ended by its deadline: its shared memory and socket directory."""
        shm.cleanup_own()
        self.ports.remove_socket_dir()
        self.registry.overrides.store.close()

    def _stop_bound(self) -> float:
        config = self.config
        return stop_bound_s(config.shutdown_grace_s, config.drain_timeout_s, config.worker_stop_timeout_s)

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
        self.open_files = raise_open_files(self.config.open_files)  # before any connection, worker or region
        accept_errors.install(loop)  # out of descriptors all the same: one event a second, not thousands
        # What dead daemons left is removed now and told once listening, so that a start refused (a port
        # in use) says that in its one line only.
        self._housekeeping = {
            "removed stale shared memory": ("segments", shm.cleanup_stale()),
            "removed socket directories of dead daemons": ("directories", remove_stale_socket_dirs()),
            "removed uploaded model files of dead daemons": (
                "directories",
                self.registry.overrides.store.remove_stale(),
            ),
        }
        shm.keep_record()
        try:
            return await self._serve()
        except BaseException:  # a start that failed half way ends within the bound too, its ports closed
            self.deadline.arm(self._stop_bound(), "the daemon failed")
            await self.ports.stop_servers(0)
            await self.registry.shutdown()
            raise
        finally:  # whatever failed: no front outlives the daemon, no socket directory stays behind
            await self.awake.stop()
            if self.ports.fronts is not None:
                await self.ports.fronts.stop(0.0)
            self.ports.remove_socket_dir()

    async def _serve(self) -> int:
        self.ports.build()
        fronts = self.ports.fronts
        for server in self.ports.servers:
            await server.start()
        if fronts is not None:
            await fronts.start()
        for endpoint in self.ports.http_endpoints:
            await endpoint.start()
        await self.metrics.start()
        await self.awake.start()
        tell(self.open_files)
        for event, (field, removed) in self._housekeeping.items():
            if removed:
                log.info(event, **{field: removed})
        front_ports = list(fronts.ports) if fronts is not None else []
        log.info(
            "listening",
            address=self.config.grpc_address,
            repository=str(self.config.model_repository),
            event_loop=eventloop.loop_name(),
            busy_poll_us=eventloop.busy_poll_us(),
            gather_us=eventloop.gather_us(),
            **({"front_ports": front_ports} if front_ports else {}),
        )
        await self._update_health()
        background = [
            asyncio.create_task(self._watchdog(), name="watchdog"),
            asyncio.create_task(self._start_models(front_ports), name="models"),
        ]
        reload: asyncio.Task[None] | None = None  # a SIGHUP's, in the background: a stop is heard meanwhile
        while not self._stop.is_set():
            reloading = reload is not None and not reload.done()
            wake: asyncio.Future[Any] = (
                reload if reload is not None and reloading else asyncio.ensure_future(self._hup.wait())
            )
            stop = asyncio.create_task(self._stop.wait())
            await asyncio.wait({wake, stop}, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            if not reloading:
                wake.cancel()
            if self._hup.is_set() and not self._stop.is_set() and (reload is None or reload.done()):
                self._hup.clear()  # SIGHUPs during a reload: one more reload after it
                reload = asyncio.create_task(self._on_hup(), name="reload")
                background.append(reload)
            await self._update_health()
        return await self._shutdown(asyncio.ensure_future(self._end(background)))

    async def _start_models(self, front_ports: list[int]) -> None:
        """Load the repository, then keep it in line with its files. It runs beside the main loop, so a stop
        signal during a long or hung load is heard at once, and ServerLive answers all along."""
        try:
            await self.reconciler.run_once(wait_quiet=False)
        except Exception:  # not one model's (those are kept in the model): the next trigger tries again
            log.exception("reconcile failed")
        self.registry.residency.start()
        await self._update_health()
        ready = self.registry.server_ready()
        log.info(
            "ready" if ready else "started with unavailable models",
            models=len(self.registry.entries),
            frozen_objects=settle_collector(),
            **({"front_ports": front_ports} if front_ports else {}),
        )
        self._started = True
        self.notifier.ready()
        self.notifier.status(self._status_line())
        mode = self.config.model_control
        watch = [self._watch(mode)] if mode in ("watch", "poll") else []
        await asyncio.gather(self.reconciler.run_forever(), *watch)

    async def _end(self, tasks: list[asyncio.Task[None]]) -> None:
        """Cancel the background work (loads in progress stop their workers) and wait for it, bounded: a task
        that does not end is left to the exit deadline."""
        for task in tasks:
            task.cancel()
        done, pending = await asyncio.wait(tasks, timeout=self.config.worker_stop_timeout_s + MARGIN_S)
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                log.error("background task failed", task=task.get_name(), exc_info=task.exception())
        if pending:
            log.error("background tasks still running at shutdown", tasks=[t.get_name() for t in pending])

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
        try:
            await self.reconciler.run_once()
        except Exception:  # not one model's (those are kept in the model): the next trigger tries again
            log.exception("reconcile failed")
        await self._update_health()
        if self._started:  # before the first load has finished, the service is not ready yet
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
            check_replacement(self.ports.tls(), tls)
        except ConfigError as exc:
            log.error("config not reloaded", reason=exc.message)
            return
        for key in ("log_level", "drain_timeout_s", "memory_budget_policy", "reload_quiet_period_s"):
            setattr(self.config, key, getattr(fresh, key))
        set_level(self.config.log_level)
        self.registry.drain_timeout_s = self.config.drain_timeout_s
        self.registry.budget_policy = self.config.memory_budget_policy
        self.registry.quiet_period_s = self.config.reload_quiet_period_s
        self.ports.reload_access(fresh, tokens, tls)

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
            self.deadline.arm(SECOND_SIGNAL_S, "a second stop signal")
            self.config.drain_timeout_s = 0.0
            self._skip_grace.set()
            if not self.refusing.is_set():  # still in the grace: the drain, next, now takes no time
                return
            if self.ports.fronts is not None:
                self.ports.fronts.hurry()
            for endpoint in self.ports.http_endpoints:
                endpoint.hurry()
            if self.ports.servers:
                self._hurry = asyncio.ensure_future(self.ports.stop_servers(0))
            return
        log.info(
            "stopping: health not serving",
            shutdown_grace_s=self.config.shutdown_grace_s,
            drain_timeout_s=self.config.drain_timeout_s,
        )
        self.deadline.arm(self._stop_bound(), "the stop signal")
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

    async def _shutdown(self, ending: asyncio.Future[None]) -> int:
        """The orderly stop; EXIT_CUT_SHORT when requests were still in flight as the drain ended. The
        background work (`ending`: loads in progress among it) ends beside the grace and the drain."""
        self.notifier.stopping()
        await self._update_health()
        await self._grace()
        self.refusing.set()
        log.info("stopping: draining in-flight requests", drain_timeout_s=self.config.drain_timeout_s)
        self.admin.close()
        drain = self.config.drain_timeout_s
        drained = asyncio.ensure_future(self._drained(drain))
        ports = self.ports
        http = asyncio.gather(*(endpoint.stop(drain) for endpoint in ports.http_endpoints))
        # The public port drains beside the fronts; the private server (last) after them: it serves them.
        private = ports.servers[-1:] if ports.fronts is not None else []
        public = asyncio.gather(*(server.stop(drain) for server in ports.servers if server not in private))
        if ports.fronts is not None:
            await ports.fronts.stop(drain)
        await asyncio.gather(public, *(server.stop(drain) for server in private))
        await http
        clean = await drained
        await self.metrics.stop()
        await ending
        await self.registry.shutdown()
        await asyncio.to_thread(self.ops.tracing.shutdown)  # the spans still held go out
        shm.cleanup_own()
        if clean:
            log.info("stopped")
            return EXIT_CLEAN
        log.warning("stopped; the drain was cut short with requests in flight", exit_status=EXIT_CUT_SHORT)
        return EXIT_CUT_SHORT

    async def _drained(self, timeout_s: float) -> bool:
        """Whether every request in flight was answered before the drain ended (its time, or a second stop
        signal)."""
        if not self.registry.in_flight():
            return True
        idle = asyncio.ensure_future(self.registry.idle())
        hurry = asyncio.ensure_future(self._skip_grace.wait()) if timeout_s > 0 else None
        waits = {idle} if hurry is None else {idle, hurry}
        try:
            await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in waits:
                task.cancel()
        return idle.done() and not idle.cancelled()


def serve(config: DaemonConfig, config_path: Path | None = None) -> int:
    eventloop.check(config.event_loop)  # before anything starts; `mpsd serve` checks it with the config
    setproctitle(f"mpsd: daemon {config.grpc_address}")  # named in ps by role and address
    try:
        polling = busy_poll_us(config, front_plan(config).count)
    except ConfigError:  # the start reports the settings that cannot work, with its own words
        polling = config.busy_poll_us
    return eventloop.run(Daemon(config, config_path).run(), config.event_loop, polling, config.gather_us)
