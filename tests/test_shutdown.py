"""SIGTERM always ends the daemon, within `shutdown_grace_s + drain_timeout_s + worker_stop_timeout_s` and a
few seconds, whatever runs: a load that hangs, requests that outlast the drain, a stuck event loop. Its exit
status says whether the drain was clean (0) or cut short (1); the exit deadline's own is 70. ServerLive
answers while models load, however long a load takes. And what load balancers rely on: at SIGTERM health
says NOT_SERVING at once while new calls are still served for `shutdown_grace_s`, and
`max_connection_age_s` makes a long-lived gRPC connection reconnect without failing a call."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.utils import InferenceServerException

from mpsd.daemon.shutdown import EXIT_CUT_SHORT, EXIT_FORCED, MARGIN_S, SECOND_SIGNAL_S, ExitDeadline
from tests import models
from tests.conftest import (
    ROOT,
    RunningDaemon,
    free_port,
    http_request,
    pending_requests,
    serve_command,
    wait_for,
)
from tests.os_skips import shared_port_fronts

DRAIN_S, STOP_S = 2.0, 2.0
BOUND_S = DRAIN_S + STOP_S + MARGIN_S  # with the tests' shutdown_grace_s of 0


def hung_model(repo: Path, name: str = "hung") -> None:
    """A python model whose __init__ never returns: its load hangs until the worker is killed."""
    models.python_model(repo, name, "return {'y': inputs['x']}")
    source = repo / name / "1" / "model.py"
    text = source.read_text().replace(
        "self.config = config", "self.config = config\n        time.sleep(3600)"
    )
    source.write_text(text)


def daemon_config(tmp: Path, **extra: object) -> Path:
    path = tmp / "mpsd.yaml"
    lines = [f"drain_timeout_s: {DRAIN_S}", f"worker_stop_timeout_s: {STOP_S}", "worker_start_timeout_s: 600"]
    lines += [f"{key}: {value}" for key, value in extra.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def loading(daemon: RunningDaemon, name: str) -> bool:
    rows = daemon.client.get_model_repository_index(as_json=True).get("models", [])
    return any(r["name"] == name and r.get("state") == "LOADING" for r in rows)


def stop_within(daemon: RunningDaemon, expected: int, bound_s: float = BOUND_S) -> None:
    """SIGTERM, then the exit status and how long it took, against the bound."""
    started = time.monotonic()
    daemon.proc.send_signal(signal.SIGTERM)
    code = daemon.proc.wait(120)
    took = time.monotonic() - started
    assert code == expected, daemon.log()[-3000:]
    assert took < bound_s, f"{took:.1f} s\n{daemon.log()[-3000:]}"


def test_live_while_a_load_hangs_and_sigterm_ends_the_daemon_within_its_bound(
    tmp_path: Path, start_daemon: object
) -> None:
    repo = tmp_path / "repo"
    models.add_sub(repo, dims=4)
    hung_model(repo)
    daemon: RunningDaemon = start_daemon(repo, config=daemon_config(tmp_path))  # type: ignore[operator]
    daemon.wait_live(60)
    wait_for(lambda: len(daemon.started_workers("hung")) == 1, 60, "the hung model's worker started")
    wait_for(lambda: daemon.client.is_model_ready("add_sub"), 60, "add_sub ready beside it")
    for _ in range(3):  # liveness answers, over gRPC and HTTP, all the while the load hangs
        assert loading(daemon, "hung")
        assert daemon.client.is_server_live()
        assert http_request(daemon.http_address, "GET", "/v2/health/live")[0] == 200
    workers = daemon.worker_pids()
    stop_within(daemon, expected=0)
    wait_for(lambda: not any(psutil.pid_exists(p) for p in workers), 10, "no worker left")


def test_sigterm_during_a_sighup_reload_that_hangs_ends_the_daemon_cleanly(
    tmp_path: Path, start_daemon: object
) -> None:
    """A reload runs beside the main loop: the stop signal is heard while it hangs in a model's load."""
    repo = tmp_path / "repo"
    models.add_sub(repo, dims=4)
    config = daemon_config(tmp_path, model_control="explicit", reload_quiet_period_s=0)
    daemon: RunningDaemon = start_daemon(repo, config=config)  # type: ignore[operator]
    daemon.wait_ready()
    hung_model(repo)
    daemon.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: len(daemon.started_workers("hung")) == 1, 60, "the reload's hung worker started")
    assert daemon.client.is_server_live()
    stop_within(daemon, expected=0)
    log = daemon.log()
    assert "reload requested (SIGHUP)" in log and "did not stop in time" not in log
    assert "never retrieved" not in log


def test_a_second_sigterm_ends_the_daemon_at_once(tmp_path: Path, start_daemon: object) -> None:
    repo = tmp_path / "repo"
    models.add_sub(repo, dims=4)
    hung_model(repo)
    daemon: RunningDaemon = start_daemon(  # type: ignore[operator]
        repo, config=daemon_config(tmp_path), shutdown_grace=60
    )
    daemon.wait_live(60)
    wait_for(lambda: len(daemon.started_workers("hung")) == 1, 60, "the hung model's worker started")
    daemon.proc.send_signal(signal.SIGTERM)
    with grpc.insecure_channel(daemon.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        wait_for(
            lambda: (
                health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status
                == health_pb2.HealthCheckResponse.NOT_SERVING
            ),
            30,
            "health NOT_SERVING: the first signal was taken",
        )
    started = time.monotonic()
    daemon.proc.send_signal(signal.SIGTERM)
    code = daemon.proc.wait(120)
    took = time.monotonic() - started
    assert code == 0, daemon.log()[-3000:]  # nothing was in flight: nothing was cut short
    assert took < SECOND_SIGNAL_S + 3, f"{took:.1f} s\n{daemon.log()[-3000:]}"


WAITS = """
deadline = time.monotonic() + float(inputs['x'][0])
while time.monotonic() < deadline:
    time.sleep(0.05)
return {'y': inputs['x']}
"""


def test_a_drain_cut_short_exits_1_and_the_request_ends_in_an_error(
    tmp_path: Path, start_daemon: object
) -> None:
    repo = tmp_path / "repo"
    models.python_model(repo, "slow", WAITS)
    metrics = f"127.0.0.1:{free_port()}"
    daemon: RunningDaemon = start_daemon(  # type: ignore[operator]
        repo, config=daemon_config(tmp_path), extra_args=["--metrics-address", metrics]
    )
    daemon.wait_ready()
    outcome: list[object] = []

    def call() -> None:
        client = grpcclient.InferenceServerClient(daemon.address)
        x = grpcclient.InferInput("x", [1], "FP32")
        x.set_data_from_numpy(np.array([60.0], dtype=np.float32))  # far longer than the drain
        try:
            outcome.append(client.infer("slow", [x]))
        except InferenceServerException as exc:
            outcome.append(exc)
        finally:
            client.close()

    caller = threading.Thread(target=call)
    caller.start()
    wait_for(lambda: pending_requests(metrics) == 1, 30, "the request in the daemon")
    started = time.monotonic()
    daemon.proc.send_signal(signal.SIGTERM)
    code = daemon.proc.wait(120)
    took = time.monotonic() - started
    caller.join(30)
    assert code == EXIT_CUT_SHORT, daemon.log()[-3000:]
    assert took < BOUND_S, f"{took:.1f} s\n{daemon.log()[-3000:]}"
    assert len(outcome) == 1 and isinstance(outcome[0], InferenceServerException), outcome
    assert "the drain was cut short" in daemon.log()


STUCK = textwrap.dedent(
    """
    import asyncio, subprocess, sys, time
    from mpsd.daemon.shutdown import ExitDeadline

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    print(child.pid, flush=True)
    deadline = ExitDeadline(lambda: open(sys.argv[1], "w").close())

    async def main() -> None:
        deadline.arm(1.0, "a test")
        time.sleep(120)  # the event loop itself is stuck: no task, no signal handler of the loop runs

    asyncio.run(main())
    """
)


def test_the_exit_deadline_ends_a_process_whose_event_loop_is_stuck(tmp_path: Path) -> None:
    """Its children are killed, its files removed (`cleanup`), and it exits 70."""
    marker = tmp_path / "cleaned"
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-c", STUCK, str(marker)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        child = int(proc.stdout.readline())
        code = proc.wait(60)
        took = time.monotonic() - started
        output = proc.stdout.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    assert code == EXIT_FORCED, output
    assert took < 30, took
    assert marker.exists()
    assert "did not stop in time" in output
    wait_for(lambda: not psutil.pid_exists(child) or psutil.Process(child).status() == "zombie", 10, "child")


def test_an_earlier_deadline_wins_and_a_later_one_does_not_postpone_it() -> None:
    fired: list[int] = []
    done = threading.Event()

    def exit_now(code: int) -> None:
        fired.append(code)
        done.set()

    deadline = ExitDeadline(lambda: None, exit_now=exit_now)
    deadline.arm(600.0, "late")
    deadline.arm(0.05, "early")
    deadline.arm(600.0, "later still")
    assert done.wait(30), "the earlier deadline did not fire"
    assert fired == [EXIT_FORCED]


@shared_port_fronts()
def test_a_start_that_fails_half_way_ends_the_daemon_with_70_and_nothing_left(tmp_path: Path) -> None:
    """The gRPC port already listens when the fronts fail to start (here every front exits at once, by a
    `sitecustomize` that only fronts act on): the daemon closes what it opened and exits 70, in one line."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(
        "import sys\nif 'mpsd.front' in getattr(sys, 'orig_argv', []):\n    sys.exit(3)\n"
    )
    repo = tmp_path / "repo"
    models.add_sub(repo, dims=4)
    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    serve = serve_command(repo, address)
    with subprocess.Popen(
        [*serve, "--http-address", "off", "--metrics-address", "off", "--front-processes", "1"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": f"{hooks}{os.pathsep}{ROOT}"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            _, stderr = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    took = time.monotonic() - started
    assert proc.returncode == EXIT_FORCED, stderr
    # beside the log events (the front's own words among them), the daemon's: one line and a hint, no
    # traceback and no `Error in sys.excepthook`
    lines = [line for line in stderr.splitlines() if line.strip() and not line.startswith("{")]
    assert len(lines) == 2, stderr
    assert lines[0].startswith("mpsd: the daemon failed: front process 0 could not start"), stderr
    assert lines[1].startswith("hint: "), stderr
    assert took < 60, took
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)  # nothing of its process group is left


# ---- the drain as load balancers see it ------------------------------------------------------------------
# At SIGTERM health says NOT_SERVING at once while new calls are still served for `shutdown_grace_s`, and
# `max_connection_age_s` makes a long-lived gRPC connection reconnect (GOAWAY) without failing a call.

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
