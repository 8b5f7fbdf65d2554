"""Standard gRPC health and reflection against a real daemon, through the stock stubs.

The promises: a model's health follows its load, failure, worker death and unload as it happens; KServe's
ServerLive/ServerReady/ModelReady say the same thing; at SIGTERM a Watch stream sees NOT_SERVING before
the connection closes, and an open Watch does not hold the drain.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tritonclient.utils import InferenceServerException

from mpsd.proto import admin_pb2, admin_pb2_grpc
from tests import models
from tests.conftest import RunningDaemon

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
INFERENCE = "inference.GRPCInferenceService"
ADMIN = "mpsd.v1.MpsdAdmin"


def write_config(path: Path, **settings: object) -> Path:
    path.write_text(yaml.safe_dump({"metrics_address": "", "model_control": "explicit", **settings}))
    return path


def echo_model(repo: Path, name: str, slow_warmup: bool = False) -> None:
    """`y = x`; with `slow_warmup` the warm-up (all zeros) takes a second, so loading is observable."""
    wait = "if float(inputs['x'].sum()) == 0:\n    time.sleep(1)\n" if slow_warmup else ""
    models.python_model(repo, name, wait + "return {'y': inputs['x']}")


def broken_model(repo: Path, name: str) -> None:
    models.python_model(repo, name, "raise RuntimeError('broken on purpose')")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    repo = tmp_path_factory.mktemp("repo")
    echo_model(repo, "echo")
    broken_model(repo, "broken")
    # A long first restart delay keeps the "restarting" window wide open after a kill.
    config = write_config(tmp_path_factory.mktemp("config") / "mpsd.yaml", restart_backoff_initial_s=2.0)
    d = RunningDaemon(repo, tmp_path_factory.mktemp("log") / "daemon.log", config=config)
    try:
        d.wait_models_settled()
        yield d
    finally:
        d.stop()
        d.kill_group()


@pytest.fixture(scope="module")
def channel(daemon: RunningDaemon) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(daemon.address) as ch:
        yield ch


@pytest.fixture(scope="module")
def health(channel: grpc.Channel) -> health_pb2_grpc.HealthStub:
    return health_pb2_grpc.HealthStub(channel)


def check(stub: health_pb2_grpc.HealthStub, service: str) -> int:
    return int(stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status)


def watch(stub: health_pb2_grpc.HealthStub, service: str) -> Iterator[int]:
    call = stub.Watch(health_pb2.HealthCheckRequest(service=service), timeout=120)
    return (int(reply.status) for reply in call)


def worker_pid(channel: grpc.Channel, model: str) -> int:
    admin = admin_pb2_grpc.MpsdAdminStub(channel)
    [worker] = admin.ListWorkers(admin_pb2.ListWorkersRequest(model=model), timeout=10).workers
    return int(worker.pid)


def test_check_agrees_with_kserve(daemon: RunningDaemon, health: health_pb2_grpc.HealthStub) -> None:
    c = daemon.client
    assert check(health, "") == SERVING and c.is_server_live()
    assert check(health, ADMIN) == SERVING
    assert check(health, "echo") == SERVING and c.is_model_ready("echo")
    assert check(health, "broken") == NOT_SERVING and not c.is_model_ready("broken")
    # Triton's strict readiness: one model that failed to load makes the server not ready.
    assert check(health, INFERENCE) == NOT_SERVING and not c.is_server_ready()


def test_unknown_name_is_not_found(daemon: RunningDaemon, health: health_pb2_grpc.HealthStub) -> None:
    with pytest.raises(grpc.RpcError) as err:
        check(health, "no_such_model")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert not daemon.client.is_model_ready("no_such_model")
    assert next(watch(health, "no_such_model")) == SERVICE_UNKNOWN


def test_watch_follows_a_worker_kill(
    daemon: RunningDaemon, channel: grpc.Channel, health: health_pb2_grpc.HealthStub
) -> None:
    """kill -9 of the worker: NOT_SERVING at once, SERVING again once the supervisor has restarted it."""
    statuses = watch(health, "echo")
    assert next(statuses) == SERVING
    old_pid = worker_pid(channel, "echo")
    os.kill(old_pid, signal.SIGKILL)
    assert next(statuses) == NOT_SERVING
    assert check(health, "echo") == NOT_SERVING
    assert not daemon.client.is_model_ready("echo")
    assert next(statuses) == SERVING
    assert check(health, "echo") == SERVING
    assert daemon.client.is_model_ready("echo")
    assert worker_pid(channel, "echo") != old_pid


def test_watch_follows_load_and_unload(daemon: RunningDaemon, health: health_pb2_grpc.HealthStub) -> None:
    echo_model(daemon.repo, "late", slow_warmup=True)
    statuses = watch(health, "late")
    assert next(statuses) == SERVICE_UNKNOWN
    daemon.client.load_model("late")  # returns once loaded; the watch has queued what it saw meanwhile
    assert next(statuses) == NOT_SERVING
    assert next(statuses) == SERVING
    assert check(health, "late") == SERVING and daemon.client.is_model_ready("late")

    daemon.client.unload_model("late")
    assert next(statuses) == SERVICE_UNKNOWN
    with pytest.raises(grpc.RpcError) as err:
        check(health, "late")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert not daemon.client.is_model_ready("late")


def test_watch_follows_a_failed_load(daemon: RunningDaemon, health: health_pb2_grpc.HealthStub) -> None:
    broken_model(daemon.repo, "late_broken")
    statuses = watch(health, "late_broken")
    assert next(statuses) == SERVICE_UNKNOWN
    with pytest.raises(InferenceServerException, match="broken on purpose"):
        daemon.client.load_model("late_broken")
    assert next(statuses) == NOT_SERVING
    assert check(health, "late_broken") == NOT_SERVING
    assert not daemon.client.is_model_ready("late_broken")


def test_reflection_lists_every_service(channel: grpc.Channel) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    requests = [
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol=ADMIN),
    ]
    listed, admin_file = list(stub.ServerReflectionInfo(iter(requests), timeout=10))
    names = {s.name for s in listed.list_services_response.service}
    assert {INFERENCE, "grpc.health.v1.Health", ADMIN, "grpc.reflection.v1alpha.ServerReflection"} <= names
    proto = descriptor_pb2.FileDescriptorProto.FromString(
        admin_file.file_descriptor_response.file_descriptor_proto[0]
    )
    [service] = proto.service
    assert (proto.package, service.name) == ("mpsd.v1", "MpsdAdmin")
    assert {m.name for m in service.method} == {"StreamLogs", "ListWorkers", "Reload", "Profile"}


def test_sigterm_turns_watches_not_serving_and_ends_them(start_daemon, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    repo = tmp_path / "repo"
    echo_model(repo, "echo")
    # A drain this long would outlast the test if an open Watch held the server's shutdown.
    config = write_config(tmp_path / "mpsd.yaml", drain_timeout_s=600)
    d: RunningDaemon = start_daemon(repo, config=config)
    d.wait_ready()
    with grpc.insecure_channel(d.address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        server, model = watch(stub, ""), watch(stub, "echo")
        assert next(server) == SERVING and next(model) == SERVING
        d.proc.send_signal(signal.SIGTERM)
        assert next(server) == NOT_SERVING
        assert next(model) == NOT_SERVING
        for statuses in (server, model):  # then the daemon ends the stream cleanly (status OK)
            assert list(statuses) == []
    assert d.proc.wait(60) == 0


def test_the_server_is_not_ready_before_the_repository_was_read(tmp_path: Path) -> None:
    """gRPC (and the front processes) listen before the first scan: an empty registry then means "not read
    yet", and ServerReady must not say ready with no model known (a client would get NOT_FOUND)."""
    import asyncio

    from mpsd.daemon.core.registry import Registry
    from mpsd.daemon.supervise.instance import SupervisorSettings

    async def check() -> None:
        registry = Registry(tmp_path, SupervisorSettings(), drain_timeout_s=1.0)
        assert not registry.server_ready()
        await registry.reconcile(only=["absent"], wait_quiet=False)  # a partial load is not a scan
        assert not registry.server_ready()
        await registry.reconcile(wait_quiet=False)
        assert registry.server_ready()  # read, and empty: nothing to wait for

    asyncio.run(check())


def test_a_shutdown_that_comes_while_a_watch_writes_still_reaches_the_watcher() -> None:
    """The client can have a status before the daemon's write of it has completed. A shutdown that comes
    in between must still be written (NOT_SERVING) before the stream ends."""
    import asyncio

    from mpsd.daemon.api.grpc.health import HealthService

    service = HealthService({"": SERVING}.get)

    class Context:
        def __init__(self) -> None:
            self.sent: list[int] = []

        async def write(self, reply: health_pb2.HealthCheckResponse) -> None:
            self.sent.append(int(reply.status))
            if len(self.sent) == 1:
                service.close()  # SIGTERM, while the first write is still in flight
            await asyncio.sleep(0)

    async def scenario() -> list[int]:
        context = Context()
        await asyncio.wait_for(service.Watch(health_pb2.HealthCheckRequest(service=""), context), 5)
        return context.sent

    assert asyncio.run(scenario()) == [SERVING, NOT_SERVING]


class WatchContext:
    """A Watch call's context, in-process: what the service writes, in order."""

    def __init__(self) -> None:
        self.sent: asyncio.Queue[int] = asyncio.Queue()

    async def write(self, reply: health_pb2.HealthCheckResponse) -> None:
        await self.sent.put(int(reply.status))


def test_a_lifecycle_event_rechecks_the_watches_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/observability.md: a Watch re-evaluates on every lifecycle event, not only at its once-a-second
    recheck, which is pushed out of reach here (an hour): the change reaches the watcher only through the
    event."""
    from mpsd.daemon.api.grpc import health
    from mpsd.logs.events import EventBus

    monkeypatch.setattr(health, "WATCH_RECHECK_S", 3600.0)
    statuses = {"model": SERVING}

    async def scenario() -> int:
        service, bus, context = health.HealthService(statuses.get), EventBus(), WatchContext()
        service.follow(bus)
        watching = asyncio.create_task(service.Watch(health_pb2.HealthCheckRequest(service="model"), context))
        assert await asyncio.wait_for(context.sent.get(), 5) == SERVING
        statuses["model"] = NOT_SERVING
        bus.publish({"event": "worker died", "event_kind": "crash", "level": "error", "model": "model"})
        status = await asyncio.wait_for(context.sent.get(), 5)
        service.close()
        await asyncio.wait_for(watching, 5)
        return status

    assert asyncio.run(scenario()) == NOT_SERVING


def test_a_watch_rechecks_once_a_second_without_an_event() -> None:
    """Watches re-evaluate on lifecycle events, and once a second as a safety net: a change of readiness
    that no event announced still reaches the watcher within the second (2 s allowed for a slow machine;
    the bounds are the documented second, not the module's constant, so a slower re-check fails)."""
    from mpsd.daemon.api.grpc.health import HealthService

    statuses = {"model": SERVING}

    async def scenario() -> tuple[int, float]:
        service = HealthService(statuses.get)
        context = WatchContext()
        loop = asyncio.get_running_loop()
        watching = asyncio.create_task(service.Watch(health_pb2.HealthCheckRequest(service="model"), context))
        assert await asyncio.wait_for(context.sent.get(), 5) == SERVING
        statuses["model"] = NOT_SERVING  # no event, no service.changed()
        changed_at = loop.time()
        status = await asyncio.wait_for(context.sent.get(), 5)
        delay = loop.time() - changed_at
        service.close()
        await asyncio.wait_for(watching, 5)
        return status, delay

    status, delay = asyncio.run(scenario())
    assert status == NOT_SERVING
    assert delay <= 2.0, delay
