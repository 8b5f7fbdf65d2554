"""The daemon's lifecycle: start the gRPC front, load the repository, serve, shut down cleanly.

Signal handlers only set flags and wake the main loop; the loop does the work.
"""

from __future__ import annotations

import asyncio
import signal

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from mpsd.config.daemon_config import DaemonConfig
from mpsd.ipc import shm
from mpsd.proto import grpc_service_pb2 as pb
from mpsd.proto import grpc_service_pb2_grpc as pb_grpc

from .instance import SupervisorSettings
from .registry import Registry
from .servicer import InferenceServicer

log = structlog.get_logger("mpsd.daemon")
INFERENCE_SERVICE = "inference.GRPCInferenceService"


class Daemon:
    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        settings = SupervisorSettings(
            start_timeout_s=config.worker_start_timeout_s,
            stop_timeout_s=config.worker_stop_timeout_s,
            backoff_initial_s=config.restart_backoff_initial_s,
            backoff_max_s=config.restart_backoff_max_s,
        )
        self.registry = Registry(
            config.model_repository, settings, config.drain_timeout_s, config.memory_budget_policy
        )
        self.health = health.aio.HealthServicer()
        self.shutting_down = False
        self._stop = asyncio.Event()
        self._reload = asyncio.Event()
        self._server: grpc.aio.Server | None = None
        self._hurry: asyncio.Future[None] | None = None

    def _build_server(self) -> grpc.aio.Server:
        limit = self.config.max_message_bytes
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
                ("grpc.so_reuseport", 0),
            ]
        )
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(  # type: ignore[no-untyped-call]
            InferenceServicer(self.registry, lambda: self.shutting_down), server
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (
                pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            server,
        )
        if server.add_insecure_port(self.config.grpc_address) == 0:
            raise OSError(f"cannot listen on {self.config.grpc_address}")
        return server

    async def _update_health(self) -> None:
        serving = health_pb2.HealthCheckResponse.SERVING
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        if self.shutting_down:
            await self.health.enter_graceful_shutdown()
            return
        await self.health.set("", serving)
        await self.health.set(INFERENCE_SERVICE, serving if self.registry.server_ready() else not_serving)
        for name in list(self.registry.entries):
            await self.health.set(name, serving if self.registry.model_ready(name) else not_serving)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_stop_signal)
        loop.add_signal_handler(signal.SIGHUP, self._reload.set)
        removed = shm.cleanup_stale()
        if removed:
            log.info("removed stale shared memory", segments=removed)
        self._server = self._build_server()
        await self._server.start()
        log.info("listening", address=self.config.grpc_address, repository=str(self.config.model_repository))
        await self._update_health()
        await self.registry.load_repository()
        await self._update_health()
        log.info(
            "ready" if self.registry.server_ready() else "started with unavailable models",
            models=len(self.registry.entries),
        )
        while not self._stop.is_set():
            reload_wait = asyncio.create_task(self._reload.wait())
            stop_wait = asyncio.create_task(self._stop.wait())
            await asyncio.wait({reload_wait, stop_wait}, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
            reload_wait.cancel()
            stop_wait.cancel()
            if self._reload.is_set() and not self._stop.is_set():
                self._reload.clear()
                await self.registry.load_repository()
            await self._update_health()
        await self._shutdown()
        return 0

    def _on_stop_signal(self) -> None:
        if self._stop.is_set():
            log.warning("second stop signal: ending the drain now")
            self.config.drain_timeout_s = 0.0
            if self._server is not None:
                self._hurry = asyncio.ensure_future(self._server.stop(0))
            return
        log.info("stopping: draining in-flight requests", drain_timeout_s=self.config.drain_timeout_s)
        self.shutting_down = True
        self._stop.set()

    async def _shutdown(self) -> None:
        await self._update_health()
        assert self._server is not None
        await self._server.stop(self.config.drain_timeout_s)
        await self.registry.shutdown()
        log.info("stopped")


def serve(config: DaemonConfig) -> int:
    return asyncio.run(Daemon(config).run())
