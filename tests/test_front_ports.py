"""Front processes on ports of their own (`front_ports`): more cores for gRPC where a port cannot be shared
(macOS), with the clients spreading their calls over the ports (gRPC's round_robin, `mpsd.client`).

Checked against a real daemon with two such fronts, real workers and the stock tritonclient:

- each front listens alone on its port and the daemon still serves its own address; ListWorkers,
  `mpsd status` and the ready event name the ports;
- every port serves the daemon's whole service (health, a model's health, metadata, ModelInfer);
- a balanced channel (`front_target`, `balanced_channel_args`) spreads its calls over both fronts, as
  each front's count of calls handed to the daemon shows;
- a killed front is restarted on its port while a balanced client under load fails no call;
- TLS and tokens apply on the front ports as on the daemon's;
- settings the ports cannot serve are configuration errors, on macOS too.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.utils import InferenceServerException

from mpsd.client import balanced_channel_args, front_target
from mpsd.proto import admin_pb2, admin_pb2_grpc
from tests import models
from tests.conftest import ROOT, RunningDaemon, free_port, serving, wait_for
from tests.test_scale_out import Load, grpc_call

DIMS = 4  # the add_sub of test_scale_out's load


class Setup:
    def __init__(self, daemon: RunningDaemon, ports: list[int]) -> None:
        self.daemon = daemon
        self.ports = ports


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    base = tmp_path_factory.mktemp("front_ports")
    models.add_sub(base / "repo", dims=DIMS)
    ports = [free_port(), free_port()]
    config = base / "mpsd.yaml"
    config.write_text(yaml.safe_dump({"metrics_address": "", "front_ports": ports}))
    with serving(base / "repo", base / "daemon.log", config=config) as daemon:
        yield Setup(daemon, ports)


def fronts(address: str, **call: object) -> dict[int, admin_pb2.Front]:
    """The daemon's fronts by port, as ListWorkers lists them (pid, state, calls handed over, restarts)."""
    with grpc.insecure_channel(address) as channel:
        reply = admin_pb2_grpc.MpsdAdminStub(channel).ListWorkers(  # type: ignore[no-untyped-call]
            admin_pb2.ListWorkersRequest(), timeout=10, **call
        )
    return {f.port: f for f in reply.fronts}


def handed(setup: Setup) -> dict[int, int]:
    """ModelInfer calls each front (by port) has handed to the daemon so far."""
    return {port: int(f.requests) for port, f in fronts(setup.daemon.address).items()}


def add_sub_inputs() -> list[grpcclient.InferInput]:
    a = np.arange(DIMS, dtype=np.float32).reshape(1, DIMS)
    inputs = [grpcclient.InferInput(n, [1, DIMS], "FP32") for n in ("INPUT0", "INPUT1")]
    for tensor in inputs:
        tensor.set_data_from_numpy(a)
    return inputs


def infer(client: grpcclient.InferenceServerClient, **kwargs: object) -> None:
    out = client.infer("add_sub", add_sub_inputs(), **kwargs).as_numpy("OUTPUT0")  # type: ignore[arg-type]
    assert out is not None and out.tolist() == [[0.0, 2.0, 4.0, 6.0]], out


def listeners(daemon: RunningDaemon, port: int) -> set[int]:
    """The daemon's processes (itself and its children) listening on `port`. Each process is asked for its
    own connections: the whole system's (psutil.net_connections) need root on macOS."""
    try:
        root = psutil.Process(daemon.pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return set()
    found = set()
    for process in processes:
        try:
            connections = process.net_connections("tcp")
        except psutil.NoSuchProcess:
            continue
        if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in connections):
            found.add(process.pid)
    return found


def test_each_front_listens_alone_on_its_port_and_the_daemon_on_its_address(setup: Setup) -> None:
    daemon = setup.daemon
    listed = fronts(daemon.address)
    assert sorted(listed) == sorted(setup.ports)
    assert {f.state for f in listed.values()} == {"listening"}
    for port, front in listed.items():
        assert listeners(daemon, port) == {front.pid}, f"front {front.index} alone on {port}"
    assert listeners(daemon, daemon.port) == {daemon.pid}, "the daemon serves its own address"
    events = [json.loads(line) for line in daemon.log().splitlines() if line.startswith("{")]
    (ready,) = [e for e in events if e["event"] == "ready"]
    assert ready["front_ports"] == setup.ports
    status = subprocess.run(
        [sys.executable, "-m", "mpsd", "status", "--json", "--address", daemon.address],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 0, status.stderr
    assert [f["port"] for f in json.loads(status.stdout)["fronts"]] == setup.ports


def test_the_stock_client_is_served_through_every_front_port(setup: Setup) -> None:
    for port in setup.ports:
        address = f"127.0.0.1:{port}"
        before = handed(setup)
        client = grpcclient.InferenceServerClient(address)
        try:
            assert client.is_server_live() and client.is_server_ready()
            assert client.is_model_ready("add_sub")
            assert [i.name for i in client.get_model_metadata("add_sub").inputs] == ["INPUT0", "INPUT1"]
            infer(client)
            with pytest.raises(InferenceServerException) as info:
                client.infer("nope", add_sub_inputs())
            assert info.value.status() == "StatusCode.NOT_FOUND"
        finally:
            client.close()
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for service in ("", "add_sub"):  # the daemon, one model
                reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
        after = handed(setup)
        # ModelInfer through this port went to the daemon through this port's front
        assert after[port] == before[port] + 2, (port, before, after)
        assert sum(after.values()) == sum(before.values()) + 2


def test_a_balanced_channel_spreads_its_calls_over_both_fronts(setup: Setup) -> None:
    target = front_target(setup.daemon.address)  # the ports the daemon lists
    assert target == "ipv4:" + ",".join(f"127.0.0.1:{p}" for p in setup.ports)
    client = grpcclient.InferenceServerClient(target, channel_args=balanced_channel_args())
    before = handed(setup)
    calls = 0

    def both_served() -> bool:
        nonlocal calls
        infer(client)
        calls += 1
        now = handed(setup)
        return all(now[p] > before[p] for p in setup.ports)

    try:
        wait_for(both_served, 60, "calls through both fronts", interval=0)
        start = handed(setup)
        for _ in range(20):  # both connections ready now: round_robin takes them in turn
            infer(client)
        calls += 20
    finally:
        client.close()
    after = handed(setup)
    assert sum(after.values()) - sum(before.values()) == calls, "every call went through a front"
    assert all(after[p] - start[p] >= 5 for p in setup.ports), (start, after)


def test_a_killed_front_is_restarted_on_its_port_and_a_balanced_client_fails_no_call(setup: Setup) -> None:
    port = setup.ports[0]
    target = front_target(setup.daemon.address, setup.ports)
    before = handed(setup)
    with Load(grpc_call(target, channel_args=balanced_channel_args())) as load:
        wait_for(lambda: all(n > before[p] for p, n in handed(setup).items()), 60, "both fronts serving")
        victim = fronts(setup.daemon.address)[port]
        os.kill(victim.pid, signal.SIGKILL)

        def restarted() -> bool:
            front = fronts(setup.daemon.address)[port]
            alone = listeners(setup.daemon, port) == {front.pid}
            return front.pid != victim.pid and front.state == "listening" and alone

        wait_for(restarted, 60, f"the front on {port} restarted\n{setup.daemon.log()}")
        assert fronts(setup.daemon.address)[port].restarts == victim.restarts + 1
        load.more(40)
        back = handed(setup)[port]
        wait_for(lambda: handed(setup)[port] > back, 60, "the balanced client back on the restarted front")
    assert load.failures == [], load.failures[:3]


def write_config(path: Path, **settings: object) -> Path:
    path.write_text(yaml.safe_dump({"metrics_address": "", **settings}))
    return path


def serve_once(repo: Path, config: Path) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable,
        "-m",
        "mpsd",
        "serve",
        "--model-repository",
        str(repo),
        "--config",
        str(config),
    ]
    return subprocess.run(
        command, capture_output=True, text=True, timeout=60, cwd=ROOT, stdin=subprocess.DEVNULL
    )


def test_ports_the_daemon_cannot_serve_are_configuration_errors(tmp_path: Path, sock_dir: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    grpc_port, http_port, port = free_port(), free_port(), free_port()
    addresses = {"grpc_address": f"127.0.0.1:{grpc_port}", "http_address": f"127.0.0.1:{http_port}"}
    cases = {
        "twice": ({"front_ports": [port, port]}, f"port {port} is listed more than once"),
        "grpc": ({"front_ports": [port, grpc_port]}, f"port {grpc_port} collides with grpc_address"),
        "http": ({"front_ports": [http_port]}, f"port {http_port} collides with http_address"),
        "both": ({"front_ports": [port], "front_processes": 2}, "set only one of the two"),
        "unix": (
            {"front_ports": [port], "grpc_address": f"unix://{sock_dir}/m.sock"},
            "grpc_address is a Unix socket",
        ),
        "range": ({"front_ports": [70000]}, "front_ports"),
    }
    for name, (settings, message) in cases.items():
        done = serve_once(repo, write_config(tmp_path / f"{name}.yaml", **{**addresses, **settings}))
        assert done.returncode == 78, (name, done.stderr)
        assert message in done.stderr, (name, done.stderr)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        busy = holder.getsockname()[1]
        done = serve_once(repo, write_config(tmp_path / "busy.yaml", **addresses, front_ports=[port, busy]))
    assert done.returncode == 78 and f"127.0.0.1:{busy}: the port is in use" in done.stderr, done.stderr


def test_front_ports_are_allowed_where_front_processes_are_refused() -> None:
    """macOS is simulated: the policy is asked with the platform name it would see there, on Linux."""
    from mpsd.config.daemon_config import DaemonConfig
    from mpsd.daemon.supervise.fronts.policy import FrontPlan, front_plan
    from mpsd.errors import ConfigError

    for platform in ("darwin", "linux"):
        for setting in ("auto", 0):
            config = DaemonConfig(front_ports=[8011, 8012], front_processes=setting)  # type: ignore[arg-type]
            assert front_plan(config, cpu_count=16, platform=platform) == FrontPlan(0, (8011, 8012))
    assert front_plan(DaemonConfig(), cpu_count=16, platform="darwin") == FrontPlan(0, ())
    with pytest.raises(ConfigError, match="only on Linux"):
        front_plan(DaemonConfig(front_processes=2), cpu_count=16, platform="darwin")
    with pytest.raises(ConfigError, match="collides with metrics_address"):
        front_plan(DaemonConfig(front_ports=[8002]), platform="darwin")


def test_front_target_names_each_port_on_the_daemons_host() -> None:
    assert front_target("127.0.0.1:8001", [8011, 8012]) == "ipv4:127.0.0.1:8011,127.0.0.1:8012"
    assert front_target("[::1]:8001", [8011]) == "ipv6:[::1]:8011"
    assert front_target("localhost:8001", [8011, 8012]) == "ipv4:127.0.0.1:8011,127.0.0.1:8012"
    for bad in ((), None):
        with pytest.raises(ValueError):
            front_target("8001", bad)
    with pytest.raises(ValueError, match="no fronts"):
        front_target("127.0.0.1:8001", [])


def test_tls_and_tokens_apply_on_the_front_ports(tmp_path: Path) -> None:
    from tests.test_security import bearer, make_pki

    repo = tmp_path / "repo"
    models.add_sub(repo, dims=DIMS)
    (tmp_path / "pki").mkdir()
    pki = make_pki(tmp_path / "pki")
    (tmp_path / "token").write_text("s3cret-token\n")
    (tmp_path / "token").chmod(0o600)
    ports = [free_port(), free_port()]
    config = write_config(
        tmp_path / "mpsd.yaml",
        front_ports=ports,
        tls={"cert_file": str(pki.server_cert), "key_file": str(pki.server_key)},
        auth={
            "tokens": [
                {
                    "token_file": str(tmp_path / "token"),
                    "categories": ["inference", "health", "logs-statistics"],
                }
            ]
        },
    )
    token = bearer("s3cret-token")
    daemon = RunningDaemon(repo, tmp_path / "daemon.log", config=config)
    main = grpcclient.InferenceServerClient(daemon.address, ssl=True, root_certificates=str(pki.ca))
    credentials = grpc.ssl_channel_credentials(pki.ca.read_bytes())
    try:
        wait_for(lambda: main.is_server_ready(headers=token), 120, f"ready\n{daemon.log()}")
        target = front_target(daemon.address, credentials=credentials, metadata=list(token.items()))
        assert target == "ipv4:" + ",".join(f"127.0.0.1:{p}" for p in ports)
        for port in ports:
            client = grpcclient.InferenceServerClient(
                f"127.0.0.1:{port}", ssl=True, root_certificates=str(pki.ca)
            )
            plain = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
            try:
                with pytest.raises(InferenceServerException) as info:
                    client.infer("add_sub", add_sub_inputs())
                assert info.value.status() == "StatusCode.UNAUTHENTICATED", port
                infer(client, headers=token)
                with pytest.raises(InferenceServerException):
                    plain.is_server_live(headers=token, client_timeout=3)
            finally:
                client.close()
                plain.close()
        # A balanced TLS channel names the certificate's host (the target lists addresses, not a name), and
        # sends its token as the channel's call credentials: its own health checks need it too.
        args = [*balanced_channel_args(), ("grpc.ssl_target_name_override", "localhost")]
        with_token = grpc.composite_channel_credentials(
            credentials, grpc.access_token_call_credentials("s3cret-token")
        )
        balanced = grpcclient.InferenceServerClient(target, creds=with_token, channel_args=args)
        try:
            for _ in range(4):
                infer(balanced)
        finally:
            balanced.close()
    finally:
        main.close()
        daemon.stop()
        daemon.kill_group()
