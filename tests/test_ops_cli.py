"""`mpsd status|logs|health|reload` as an operator runs them: subprocesses against a real daemon."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
import yaml

from mpsd.proto import admin_pb2, admin_pb2_grpc
from tests import models
from tests.conftest import ROOT, RunningDaemon, free_port


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    repo = tmp_path_factory.mktemp("repo")
    models.python_model(  # on the CPU wherever the tests run: the status rows below name the device
        repo,
        "echo",
        "print('echo saw', float(inputs['x'].sum()))\nreturn {'y': inputs['x']}",
        instance_group=[{"kind": "KIND_CPU", "count": 1}],
    )
    models.python_model(repo, "broken", "raise RuntimeError('broken on purpose')")
    config = tmp_path_factory.mktemp("config") / "mpsd.yaml"
    config.write_text(yaml.safe_dump({"metrics_address": "", "model_control": "explicit"}))
    d = RunningDaemon(repo, tmp_path_factory.mktemp("log") / "daemon.log", config=config)
    try:
        d.wait_models_settled()
        yield d
    finally:
        d.stop()
        d.kill_group()


def mpsd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mpsd", *args], capture_output=True, text=True, timeout=120, cwd=ROOT
    )


def test_status_table(daemon: RunningDaemon) -> None:
    run = mpsd("status", "--address", daemon.address)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == f"daemon {daemon.address}: 1 of 2 models ready"
    models = lines[2 : lines.index("", 2)]  # the first table: models and their states
    [broken] = [line for line in models if line.startswith("broken ")]
    assert "UNAVAILABLE" in broken and "broken on purpose" in broken
    [worker] = [line for line in lines if line.startswith("echo/1#0")]
    [pid] = daemon.worker_pids()
    assert worker.split()[1:4] == [str(pid), "cpu", "-"]  # pid, device, no memory fraction on CPU
    assert "ready" in worker.split() and "MiB" in worker


def test_status_json(daemon: RunningDaemon) -> None:
    run = mpsd("status", "--json", "--address", daemon.address)
    assert run.returncode == 0, run.stderr
    data = json.loads(run.stdout)
    states = {(m["name"], m["state"]) for m in data["models"]}
    assert states == {("echo", "READY"), ("broken", "UNAVAILABLE")}
    [worker] = data["workers"]
    assert worker["pid"] == daemon.worker_pids()[0]
    assert (worker["model"], worker["version"], worker["instance"]) == ("echo", 1, 0)
    assert worker["device"] == {"kind": "cpu", "index": None, "name": worker["device"]["name"]}
    assert worker["state"] == "ready" and worker["restarts"] == 0 and worker["last_exit"] is None
    assert worker["memory"]["rss_bytes"] > 0


def test_logs_replay_returns(daemon: RunningDaemon) -> None:
    run = mpsd("logs", "--replay", "50", "--address", daemon.address)
    assert run.returncode == 0, run.stderr
    assert "model ready" in run.stdout and "[echo]" in run.stdout
    failure = mpsd("logs", "--model", "broken", "--level", "error", "--json", "--address", daemon.address)
    assert failure.returncode == 0, failure.stderr
    events = [json.loads(line) for line in failure.stdout.splitlines()]
    assert events and {(e["model"], e["level"]) for e in events} == {("broken", "error")}
    assert any("broken on purpose" in e["fields"].get("reason", "") for e in events)

    # docs/observability.md: without options, the last 20 events at info level and above, then exit
    def info_events(*args: str) -> list[str]:
        run = mpsd("logs", "--json", *args, "--address", daemon.address)
        assert run.returncode == 0, run.stderr
        return run.stdout.splitlines()

    while len(everything := info_events("--replay", "2000")) <= 20:
        assert mpsd("reload", "--address", daemon.address).returncode == 0  # a few more info events
    default = [json.loads(line) for line in info_events()]
    assert [e["seq"] for e in default] == [json.loads(line)["seq"] for line in everything[-20:]]
    assert {e["level"] for e in default} <= {"info", "warning", "error"}


def test_health_exit_status(daemon: RunningDaemon) -> None:
    live = mpsd("health", "--address", daemon.address)
    assert (live.returncode, live.stdout.strip()) == (0, "daemon: SERVING")
    assert mpsd("health", "echo", "--address", daemon.address).returncode == 0
    broken = mpsd("health", "broken", "--address", daemon.address)
    assert (broken.returncode, broken.stdout.strip()) == (1, "'broken': NOT_SERVING")
    unknown = mpsd("health", "nope", "--address", daemon.address)
    assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stdout
    down = mpsd("health", "--address", f"127.0.0.1:{free_port()}")
    assert down.returncode == 69 and "cannot reach the daemon" in down.stderr


def test_reload(daemon: RunningDaemon) -> None:
    run = mpsd("reload", "--address", daemon.address)
    assert run.returncode == 0, run.stderr
    assert "changed" in run.stdout
    assert re.fullmatch(r"\d+ changed, \d+ failed, \d+ unloaded, \d+ deferred", run.stdout.strip()), (
        run.stdout
    )
    logs = mpsd("logs", "--kind", "reload", "--replay", "10", "--json", "--address", daemon.address)
    assert "reload requested" in {json.loads(line)["message"] for line in logs.stdout.splitlines()}


def test_logs_says_how_many_events_a_slow_reader_lost() -> None:
    """When the daemon had to drop events for a slow reader, the next event carries the count and `mpsd logs`
    prints "... N events dropped" (docs/observability.md). A stand-in admin service sends such an event: a
    real daemon drops only under a flood, which tests/test_logs.py makes."""

    class Admin(admin_pb2_grpc.MpsdAdminServicer):  # type: ignore[misc]
        def StreamLogs(self, request: object, context: object) -> Iterator[admin_pb2.LogEvent]:
            common = {"time": "2024-01-01T00:00:00Z", "level": "info", "kind": "daemon"}
            yield admin_pb2.LogEvent(seq=1, message="before the gap", **common)
            yield admin_pb2.LogEvent(seq=39, message="after the gap", dropped=37, **common)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    admin_pb2_grpc.add_MpsdAdminServicer_to_server(Admin(), server)
    address = f"127.0.0.1:{free_port()}"
    server.add_insecure_port(address)
    server.start()
    try:
        run = mpsd("logs", "--address", address)
    finally:
        server.stop(None)
    assert run.returncode == 0, run.stderr
    assert "before the gap" in run.stdout and "after the gap" in run.stdout
    assert "... 37 events dropped" in run.stderr
