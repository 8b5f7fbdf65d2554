"""One model's trouble stays that model's: a config this host cannot honour (a `memory_fraction` out of the
device's range, found only when the model is placed on this host's devices) makes that model UNAVAILABLE with
the reason at every entry point (start, a hot reload over a running version, RepositoryModelLoad, a load on
demand), while the daemon and every other model serve; and the one boundary that turns anything a model's
work raises into that model's state, tested in one process for the two places that enter it."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import structlog
import tritonclient.grpc as grpcclient
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.utils import InferenceServerException

from mpsd.config.daemon_config import DaemonConfig
from mpsd.config.repository import load_model_source
from mpsd.daemon.core.registry import Registry
from mpsd.daemon.core.residency.manager import NOT_LOADED_YET, Residency
from mpsd.daemon.core.rollout import ModelEntry, ModelState
from mpsd.daemon.supervise.instance import SupervisorSettings
from mpsd.errors import DeadlineExceeded, Unavailable
from tests import models
from tests.conftest import ROOT, RunningDaemon, http_request, wait_for

pytestmark = pytest.mark.skipif(
    sys.platform == "darwin", reason="on macOS KIND_AUTO and KIND_GPU use MPS, which allows fractions up to 2"
)

# The three instance groups a new user tried: each fails placement on a Linux host, with or without a GPU.
UNHONOURED = {
    "auto_fraction": {"kind": "KIND_AUTO", "memory_fraction": 1.5},
    "gpu_fraction": {"kind": "KIND_GPU", "memory_fraction": 3.5},
    "cpu_fraction": {"kind": "KIND_CPU", "memory_fraction": 0.5},
}
BOUND_S = 0.0 + 2.0 + 2.0  # shutdown_grace_s + drain_timeout_s + worker_stop_timeout_s of the daemon below


def add_sub_with(repo: Path, name: str, group: dict[str, Any]) -> Path:
    model_dir = models.add_sub(repo, name=name, dims=4)
    config = json.loads(json.dumps(_config(model_dir)))
    config["instance_group"] = [group]
    models.write_config(model_dir, config)
    return model_dir


def _config(model_dir: Path) -> dict[str, Any]:
    import yaml

    loaded: dict[str, Any] = yaml.safe_load((model_dir / "config.yaml").read_text())
    return loaded


def infer(client: grpcclient.InferenceServerClient, model: str) -> list[list[float]]:
    a = np.arange(4, dtype=np.float32).reshape(1, 4)
    inputs = [grpcclient.InferInput(n, [1, 4], "FP32") for n in ("INPUT0", "INPUT1")]
    for tensor in inputs:
        tensor.set_data_from_numpy(a)
    out = client.infer(model, inputs).as_numpy("OUTPUT0")
    assert out is not None
    result: list[list[float]] = out.tolist()
    return result


def index(daemon: RunningDaemon) -> dict[str, dict[str, str]]:
    rows = daemon.client.get_model_repository_index(as_json=True).get("models", [])
    return {row["name"]: row for row in rows}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    tmp = tmp_path_factory.mktemp("isolation")
    repo = tmp / "repo"
    models.add_sub(repo, dims=4)
    models.add_sub(repo, name="flip", dims=4)
    for name, group in UNHONOURED.items():
        add_sub_with(repo, name, group)
    cold = add_sub_with(repo, "cold_fraction", UNHONOURED["cpu_fraction"])
    config = _config(cold)
    config["residency"] = {"load": "on_demand"}
    models.write_config(cold, config)
    daemon_config = tmp / "mpsd.yaml"
    daemon_config.write_text(
        "reload_quiet_period_s: 0.2\ndrain_timeout_s: 2\nworker_stop_timeout_s: 2\nmetrics_address: off\n"
    )
    started = time.monotonic()
    d = RunningDaemon(repo, tmp / "daemon.log", config=daemon_config)
    try:
        d.wait_live(60)
        d.live_after_s = time.monotonic() - started  # type: ignore[attr-defined]
        d.wait_models_settled()
        yield d
    finally:
        d.stop()
        d.kill_group()


def test_each_unhonoured_fraction_is_that_models_state_and_the_others_serve(daemon: RunningDaemon) -> None:
    rows = index(daemon)
    for name in UNHONOURED:
        assert rows[name]["state"] == "UNAVAILABLE", rows[name]
        assert "memory_fraction" in rows[name]["reason"], rows[name]
    assert rows["add_sub"]["state"] == "READY"
    assert infer(daemon.client, "add_sub") == [[0.0, 2.0, 4.0, 6.0]]
    assert daemon.client.is_server_live() and not daemon.client.is_server_ready()
    with pytest.raises(InferenceServerException) as refused:
        infer(daemon.client, "cpu_fraction")
    assert refused.value.status() == "StatusCode.UNAVAILABLE"
    assert "memory_fraction" in str(refused.value.message())
    # health: the model's own service NOT_SERVING, the healthy one's SERVING
    with grpc.insecure_channel(daemon.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        check = health_pb2.HealthCheckRequest
        assert (
            health.Check(check(service="auto_fraction"), timeout=10).status
            == health_pb2.HealthCheckResponse.NOT_SERVING
        )
        assert (
            health.Check(check(service="add_sub"), timeout=10).status
            == health_pb2.HealthCheckResponse.SERVING
        )
    assert http_request(daemon.http_address, "GET", "/v2/models/gpu_fraction/ready")[0] != 200
    # events: one `model failed to load` per model, with the reason
    failed = [e for e in _events(daemon) if e.get("event") == "model failed to load"]
    assert {e["model"] for e in failed} >= set(UNHONOURED)
    # `mpsd status`, as an operator reads it
    status = _mpsd("status", "--address", daemon.address)
    assert status.returncode == 0, status.stderr
    for name in UNHONOURED:
        line = next(line for line in status.stdout.splitlines() if line.startswith(name))
        assert "UNAVAILABLE" in line and "memory_fraction" in status.stdout, status.stdout


def test_the_daemon_answered_server_live_within_seconds_of_start(daemon: RunningDaemon) -> None:
    assert daemon.live_after_s < 30  # type: ignore[attr-defined]
    assert http_request(daemon.http_address, "GET", "/v2/health/live")[0] == 200


def test_mpsd_validate_refuses_the_same_models(daemon: RunningDaemon) -> None:
    done = _mpsd("validate", str(daemon.repo), "--json")
    reports = {m["name"]: m for m in json.loads(done.stdout)["models"]}
    refused = {name for name, report in reports.items() if not report["ok"]}
    unavailable = {name for name, row in index(daemon).items() if row["state"] == "UNAVAILABLE"}
    assert refused == unavailable == {*UNHONOURED, "cold_fraction"}


def test_a_model_loaded_on_demand_with_such_a_fraction_is_unavailable_from_the_scan(
    daemon: RunningDaemon,
) -> None:
    row = index(daemon)["cold_fraction"]
    assert row["state"] == "UNAVAILABLE" and "memory_fraction" in row["reason"], row
    with pytest.raises(InferenceServerException) as refused:
        infer(daemon.client, "cold_fraction")
    assert refused.value.status() == "StatusCode.UNAVAILABLE"
    assert "memory_fraction" in str(refused.value.message())


def test_repository_model_load_of_such_a_model_fails_with_the_reason(daemon: RunningDaemon) -> None:
    add_sub_with(daemon.repo, "late_fraction", UNHONOURED["gpu_fraction"])
    with pytest.raises(InferenceServerException) as refused:
        daemon.client.load_model("late_fraction")
    assert "memory_fraction" in str(refused.value.message())
    row = index(daemon)["late_fraction"]
    assert row["state"] == "UNAVAILABLE" and "memory_fraction" in row["reason"], row
    assert infer(daemon.client, "add_sub") == [[0.0, 2.0, 4.0, 6.0]]


def test_a_hot_reload_to_such_a_fraction_keeps_the_running_version_serving(daemon: RunningDaemon) -> None:
    flip = daemon.repo / "flip"
    good = _config(flip)
    assert infer(daemon.client, "flip") == [[0.0, 2.0, 4.0, 6.0]]
    models.write_config(flip, {**good, "instance_group": [UNHONOURED["auto_fraction"]]})
    wait_for(
        lambda: "memory_fraction" in index(daemon)["flip"].get("reason", ""),
        60,
        f"the failed update\n{daemon.log()}",
    )
    row = index(daemon)["flip"]
    assert row["state"] == "READY" and row.get("reason", "").startswith(
        "update failed, this version keeps serving"
    )
    assert infer(daemon.client, "flip") == [[0.0, 2.0, 4.0, 6.0]]
    assert infer(daemon.client, "add_sub") == [[0.0, 2.0, 4.0, 6.0]]
    models.write_config(flip, good)  # and fixed again: the reason goes
    wait_for(lambda: index(daemon)["flip"].get("reason", "") == "", 60, f"the fixed config\n{daemon.log()}")


def test_zz_sigterm_ends_the_daemon_within_its_bound(daemon: RunningDaemon) -> None:
    """Last in the module: it stops the shared daemon."""
    started = time.monotonic()
    assert daemon.stop() == 0
    assert time.monotonic() - started < BOUND_S + 5, daemon.log()[-3000:]
    assert "Error in sys.excepthook" not in daemon.log()


# ---- the boundary, in one process ---------------------------------------------------------------------


def _registry(repo: Path) -> Registry:
    return Registry(repo, SupervisorSettings(), drain_timeout_s=1.0)


def test_a_reconcile_keeps_an_unexpected_error_in_the_models_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Anything a model's rollout raises, not only the errors of the taxonomy, is that model's: the reconcile
    reports it, the model is UNAVAILABLE with the reason, and the model beside it is brought in line."""
    repo = tmp_path / "repo"
    models.add_sub(repo, name="bad", dims=4)
    models.add_sub(repo, name="good", dims=4)
    registry = _registry(repo)
    applied: list[str] = []

    async def apply(entry: ModelEntry, source: Any) -> bool:
        if entry.name == "bad":
            raise RuntimeError("a fault no check foresaw")
        applied.append(entry.name)
        return True

    monkeypatch.setattr(registry.rollout, "apply", apply)
    report = asyncio.run(registry.reconcile(wait_quiet=False))
    assert report.failed == {"bad": "internal error: RuntimeError: a fault no check foresaw"}
    assert report.changed == ["good"] and applied == ["good"]
    bad = registry.entries["bad"]
    assert bad.state is ModelState.UNAVAILABLE and bad.error == report.failed["bad"]
    assert [(r.name, r.state, r.reason) for r in registry.index() if r.name == "bad"] == [
        ("bad", "UNAVAILABLE", report.failed["bad"])
    ]


def test_a_load_on_demand_keeps_an_unexpected_error_in_the_models_entry(tmp_path: Path) -> None:
    """The request that asked for the load hears UNAVAILABLE with the reason, and the model keeps it."""
    models.add_sub(tmp_path / "repo", name="cold", dims=4)
    source = load_model_source(tmp_path / "repo" / "cold")
    entry = ModelEntry("cold", source=source, cold_reason=NOT_LOADED_YET)

    async def apply(_source: Any) -> bool:
        raise KeyError("no such device")

    async def scenario() -> None:
        residency = Residency(DaemonConfig(), {"cold": entry}, apply, lambda _n: asyncio.Lock(), lambda: 1.0)
        with pytest.raises(Unavailable) as refused:
            await residency.ensure_loaded(entry, deadline=None)
        assert "internal error: KeyError: 'no such device'" in refused.value.message
        assert entry.error == "internal error: KeyError: 'no such device'" and not entry.loading

    with structlog.testing.capture_logs() as logged:
        asyncio.run(scenario())
    # docs/troubleshooting.md: the error nobody foresaw is in the log with its traceback
    [unexpected] = [e for e in logged if e["event"] == "unexpected error in a model's load"]
    assert unexpected["model"] == "cold" and isinstance(unexpected["exc_info"], KeyError)


def test_a_request_waits_for_a_load_on_demand_at_most_load_timeout_s(tmp_path: Path) -> None:
    """docs/memory.md: a request waits for its model's load at most `load_timeout_s` (or its own deadline),
    then hears DEADLINE_EXCEEDED while the load goes on."""
    models.add_sub(tmp_path / "repo", name="cold", dims=4)
    entry = ModelEntry(
        "cold", source=load_model_source(tmp_path / "repo" / "cold"), cold_reason=NOT_LOADED_YET
    )
    never = asyncio.Event()

    async def apply(_source: Any) -> bool:
        await never.wait()  # a load that does not end
        return True

    async def scenario() -> None:
        config = DaemonConfig.model_validate({"residency": {"load_timeout_s": 0.2}})
        residency = Residency(config, {"cold": entry}, apply, lambda _n: asyncio.Lock(), lambda: 1.0)
        with pytest.raises(DeadlineExceeded, match=r"not loaded within 0\.2 s .*load_timeout_s"):
            await residency.ensure_loaded(entry, deadline=None)
        assert entry.load_task is not None and not entry.load_task.done()  # the load goes on
        entry.load_task.cancel()

    asyncio.run(scenario())


def _events(daemon: RunningDaemon) -> list[dict[str, Any]]:
    events = []
    for line in daemon.log().splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    return events


def _mpsd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mpsd", *args], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
