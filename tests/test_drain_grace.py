"""What load balancers rely on at the daemon: at SIGTERM health says NOT_SERVING at once while new calls are
still served for `shutdown_grace_s`, and `max_connection_age_s` makes a long-lived gRPC connection
reconnect (GOAWAY) without failing a call."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests import models
from tests.conftest import RunningDaemon, http_request, wait_for
from tests.os_skips import shared_port_fronts

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVING = health_pb2.HealthCheckResponse.SERVING
BODY = (
    b'{"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]},'
    b' {"name": "INPUT1", "shape": [1, 4], "datatype": "FP32", "data": [1, 1, 1, 1]}]}'
)


def infer(client: grpcclient.InferenceServerClient) -> np.ndarray:
    a = np.arange(4, dtype=np.float32).reshape(1, 4)
    inputs = [grpcclient.InferInput(n, [1, 4], "FP32") for n in ("INPUT0", "INPUT1")]
    for tensor in inputs:
        tensor.set_data_from_numpy(a)
    out = client.infer("add_sub", inputs).as_numpy("OUTPUT0")
    assert out is not None
    return out


def check(stub: health_pb2_grpc.HealthStub, service: str) -> int:
    return int(stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status)


def test_sigterm_health_not_serving_while_new_calls_are_served_for_the_grace(
    tmp_path: Path, start_daemon: Any
) -> None:
    models.add_sub(tmp_path / "repo", dims=4)
    daemon: RunningDaemon = start_daemon(tmp_path / "repo", shutdown_grace=60)
    daemon.wait_ready()
    with grpc.insecure_channel(daemon.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        assert check(health, "add_sub") == SERVING
        daemon.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: check(health, "") == NOT_SERVING, 30, "health NOT_SERVING")
        for service in ("inference.GRPCInferenceService", "add_sub"):
            assert check(health, service) == NOT_SERVING, service
        assert http_request(daemon.http_address, "GET", "/v2/health/ready")[0] == 503
        assert http_request(daemon.http_address, "GET", "/v2/models/add_sub/ready")[0] == 503
        assert http_request(daemon.http_address, "GET", "/v2/health/live")[0] == 200
        assert not daemon.client.is_server_ready()
        # the grace: new calls, on new connections too, are still served
        assert infer(daemon.client).tolist() == [[0.0, 2.0, 4.0, 6.0]]
        with grpcclient.InferenceServerClient(daemon.address) as fresh:
            assert infer(fresh).tolist() == [[0.0, 2.0, 4.0, 6.0]]
        status, reply, _ = http_request(daemon.http_address, "POST", "/v2/models/add_sub/infer", BODY)
        assert status == 200, reply
        assert "stopping: draining in-flight requests" not in daemon.log()
    # a second SIGTERM ends the grace (and the drain) at once
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.proc.wait(60) == 0
    assert "stopping: draining in-flight requests" in daemon.log()


def test_grace_ends_by_itself_then_calls_are_refused(tmp_path: Path, start_daemon: Any) -> None:
    models.add_sub(tmp_path / "repo", dims=4)
    daemon: RunningDaemon = start_daemon(tmp_path / "repo", shutdown_grace=0.5)
    daemon.wait_ready()
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.proc.wait(60) == 0
    log = daemon.log()
    assert log.index("stopping: health not serving") < log.index("stopping: draining in-flight requests")


@pytest.mark.parametrize(
    "fronts", [pytest.param(0, id="daemon"), pytest.param(1, id="front", marks=shared_port_fronts())]
)
def test_max_connection_age_reconnects_a_long_lived_channel_without_failing_calls(
    tmp_path: Path, start_daemon: Any, fronts: int
) -> None:
    models.add_sub(tmp_path / "repo", dims=4)
    config = tmp_path / "mpsd.yaml"
    config.write_text("max_connection_age_s: 0.5\nmax_connection_age_grace_s: 5\n")
    daemon: RunningDaemon = start_daemon(
        tmp_path / "repo", config=config, extra_args=["--front-processes", str(fronts)]
    )
    daemon.wait_ready()
    channel = grpc.insecure_channel(daemon.address)
    states: list[grpc.ChannelConnectivity] = []
    lock = threading.Lock()

    def on_state(state: grpc.ChannelConnectivity) -> None:
        with lock:
            states.append(state)

    channel.subscribe(on_state, try_to_connect=True)
    client = grpcclient.InferenceServerClient(daemon.address)
    client._channel = channel  # the long-lived channel whose connections the test watches
    from tritonclient.grpc import service_pb2_grpc

    client._client_stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    calls: list[str] = []

    def connections() -> int:
        try:
            infer(client)
            calls.append("ok")
        except Exception as exc:
            calls.append(f"failed: {exc}")
        with lock:
            return states.count(grpc.ChannelConnectivity.READY)

    try:
        wait_for(lambda: connections() >= 3, 60, "the channel connected three times", interval=0.05)
    finally:
        channel.unsubscribe(on_state)
        channel.close()
    assert [c for c in calls if c != "ok"] == []
    assert len(calls) >= 3
