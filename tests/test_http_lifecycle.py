"""The HTTP server in the daemon's lifecycle: on by default beside gRPC, off on request, a busy port that
does not stop the daemon, and the drain: at SIGTERM readiness turns 503 at once while the request in
progress finishes, and the port closes only after it."""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient

from mpsd.config.daemon_config import DaemonConfig
from tests import models
from tests.conftest import RunningDaemon, free_port, http_request, pending_requests, wait_for


def test_defaults() -> None:
    assert DaemonConfig().http_address == "127.0.0.1:8000"
    assert DaemonConfig().grpc_address == "127.0.0.1:8001"


def test_sigterm_turns_readiness_503_while_the_request_in_progress_finishes(
    tmp_path: Path, start_daemon: Any
) -> None:
    repo, gate = tmp_path / "repo", tmp_path / "gate"
    gate.mkdir()
    models.gated_model(repo, gate)
    metrics = f"127.0.0.1:{free_port()}"
    daemon: RunningDaemon = start_daemon(repo, extra_args=["--metrics-address", metrics])
    daemon.wait_ready()
    body = json.dumps({"inputs": [{"name": "x", "shape": [2], "datatype": "FP32", "data": [1.0, 1.0]}]})
    answers: list[tuple[int, Any, bytes]] = []
    call = threading.Thread(
        target=lambda: answers.append(
            http_request(daemon.http_address, "POST", "/v2/models/gated/infer", body.encode(), timeout=120)
        )
    )
    call.start()
    wait_for(lambda: pending_requests(metrics) == 1, 30, "the request in the daemon")
    daemon.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: "stopping: draining in-flight requests" in daemon.log(), 30, "the drain begun")

    for path in ("/v2/health/ready", "/v2/models/gated/ready"):
        status, reply, _ = http_request(daemon.http_address, "GET", path)
        assert (status, reply) == (503, {"error": "the daemon is shutting down"}), path
    # Still live, as Triton: a liveness probe must not restart a daemon that is finishing its requests.
    assert http_request(daemon.http_address, "GET", "/v2/health/live")[0] == 200
    status, _, _ = http_request(daemon.http_address, "POST", "/v2/models/gated/infer", body.encode())
    assert status == 503, "a request during the drain was accepted"
    try:
        grpc_ready = daemon.client.is_server_ready()
    except Exception:
        grpc_ready = False  # the gRPC server refuses new calls once its drain began
    assert not grpc_ready

    (gate / "1").touch()
    call.join(60)
    assert [a[:2] for a in answers] == [
        (200, {"model_name": "gated", "model_version": "1", "outputs": [
            {"name": "y", "datatype": "FP32", "shape": [2], "data": [2.0, 2.0]}
        ]})
    ]  # fmt: skip
    assert daemon.proc.wait(60) == 0
    with pytest.raises(OSError):
        http_request(daemon.http_address, "GET", "/v2/health/live", timeout=5)


def test_http_off_and_a_busy_port(tmp_path: Path, start_daemon: Any) -> None:
    """`--http-address off` serves gRPC only; a port held by someone else is logged, and gRPC serves."""
    import socket

    repo = tmp_path / "repo"
    models.add_sub(repo, dims=4)
    off: RunningDaemon = start_daemon(repo, extra_args=["--http-address", "off"])
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        busy_address = f"127.0.0.1:{holder.getsockname()[1]}"
        busy: RunningDaemon = start_daemon(repo, extra_args=["--http-address", busy_address])
        for d in (off, busy):
            d.wait_ready()
        assert "http endpoint" not in off.log()
        assert "http endpoint not started" in busy.log()
    assert busy.client.is_server_ready()


def test_a_malformed_or_colliding_address_is_a_configuration_error(tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.conftest import ROOT

    (tmp_path / "models").mkdir()
    for address, words in (
        ("nonsense", "http_address 'nonsense'"),
        ("unix:relative.sock", "absolute path"),
        ("127.0.0.1:8001", "collide"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "mpsd", "serve", "--model-repository", str(tmp_path / "models"),
             "--grpc-address", "127.0.0.1:8001", "--http-address", address],
            capture_output=True, text=True, timeout=60, cwd=ROOT,
        )  # fmt: skip
        assert done.returncode == 78, done.stderr
        assert words in done.stderr, done.stderr


def test_the_stock_client_on_the_default_path(tmp_path: Path, start_daemon: Any) -> None:
    """The stock client's async infer (its greenlet pool) against the daemon's HTTP port."""
    repo = tmp_path / "repo"
    models.add_sub(repo, dims=4)
    daemon: RunningDaemon = start_daemon(repo)
    daemon.wait_ready()
    client = httpclient.InferenceServerClient(daemon.http_address, concurrency=4)
    try:
        a = np.ones((1, 4), np.float32)
        inputs = [httpclient.InferInput(n, [1, 4], "FP32") for n in ("INPUT0", "INPUT1")]
        for inp in inputs:
            inp.set_data_from_numpy(a)
        pending = [client.async_infer("add_sub", inputs) for _ in range(8)]
        for p in pending:
            np.testing.assert_array_equal(p.get_result().as_numpy("OUTPUT0"), a * 2)
    finally:
        client.close()
