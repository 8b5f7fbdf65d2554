"""Many models in one memory budget, through the real daemon: load on demand, unload when idle, evict the
least recently used idle model, never a pinned or busy one, refuse what cannot fit with the figures.

Footprints are declared (`residency.footprint_bytes`) and the CPU budget is given in bytes, so which model
goes is decided by the test's numbers, not by this machine's memory. The per-device memory budget of
memory fractions is checked before any worker of a model starts: refused or warned about, as configured.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests import models
from tests.conftest import RunningDaemon, free_port, serving, wait_for

MIB = 2**20
SLOW = """
if float(inputs['x'].max()) >= 1000:
    time.sleep(1.5)
return {'y': inputs['x'] + 1}
"""
HELD = """
if float(inputs['x'].max()) >= 1000:  # runs until the test releases it
    open({started!r}, 'w').close()
    while not os.path.exists({release!r}):
        time.sleep(0.01)
return {{'y': inputs['x'] + 1}}
"""
SLOW_INIT = """
import time, torch

class Model:
    def __init__(self, config, device):
        time.sleep(3)

    def infer(self, inputs):
        return {'y': inputs['x'] + 1}
"""


def model(repo: Path, name: str, footprint: int, body: str = SLOW, **residency: Any) -> None:
    models.python_model(
        repo,
        name,
        body,
        config={
            "backend": "python",
            "max_batch_size": 0,
            "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [-1]}],
            "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [-1]}],
            "instance_group": [{"kind": "KIND_CPU"}],
            "residency": {"load": "on_demand", "footprint_bytes": footprint, **residency},
        },
    )


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    tmp = tmp_path_factory.mktemp("residency")
    repo = tmp / "repo"
    model(repo, "pinned", 100 * MIB, load="startup", pinned=True)
    for name in ("a", "b", "c"):
        model(repo, name, 100 * MIB)
    model(repo, "huge", 1024 * MIB)
    model(repo, "big", 200 * MIB)
    model(repo, "idle", 1, keep_alive_s=1)
    gate = tmp / "gate"
    gate.mkdir()
    held = HELD.format(started=str(gate / "started"), release=str(gate / "release"))
    model(repo, "held", 1, body=held, keep_alive_s=1)
    model(repo, "canary", 1, keep_alive_s=1)
    model(repo, "shared", 1)
    model(repo, "slowload", 1)
    (repo / "slowload" / "1" / "model.py").write_text(SLOW_INIT)
    config = tmp / "mpsd.yaml"
    metrics = f"127.0.0.1:{free_port()}"
    config.write_text(
        yaml.safe_dump(
            {
                "memory_budget_bytes": {"cpu": 301 * MIB},  # the pinned model and two of a, b, c
                "residency": {"min_residency_s": 0},
                "metrics_address": metrics,
            }
        )
    )
    with serving(repo, tmp / "daemon.log", config=config) as running:
        running.metrics = metrics  # type: ignore[attr-defined]
        running.gate = gate  # type: ignore[attr-defined]
        yield running


def infer(daemon: RunningDaemon, name: str, value: float = 1.0, **kwargs: Any) -> np.ndarray:
    inp = grpcclient.InferInput("x", [2], "FP32")
    inp.set_data_from_numpy(np.full(2, value, np.float32))
    result = daemon.client.infer(name, [inp], **kwargs)
    return result.as_numpy("y")  # type: ignore[no-any-return]


def events(daemon: RunningDaemon, message: str) -> list[dict[str, Any]]:
    found = []
    for line in daemon.log().splitlines():
        if line.startswith("{") and f'"{message}"' in line:
            found.append(json.loads(line))
    return [e for e in found if e.get("event") == message]


def unloaded(daemon: RunningDaemon) -> list[tuple[str, str]]:
    return [(e["model"], e["reason"]) for e in events(daemon, "model unloaded")]


def index(daemon: RunningDaemon) -> dict[str, tuple[str, str]]:
    rows = daemon.client.get_model_repository_index(as_json=True)["models"]
    return {r["name"]: (r.get("state", ""), r.get("reason", "")) for r in rows}


def test_models_that_load_on_demand_are_known_and_the_server_is_ready(daemon: RunningDaemon) -> None:
    """Not loaded is not broken: the server is ready, per-model health says serving, ModelReady says
    false (nothing runs), and metadata is answered from the repository without loading."""
    rows = index(daemon)
    assert rows["pinned"][0] == "READY"
    assert rows["a"] == ("UNAVAILABLE", "not loaded yet: loads on its first request")
    assert daemon.client.is_server_ready()
    assert not daemon.client.is_model_ready("a")
    assert daemon.client.get_model_metadata("a", as_json=True)["inputs"][0]["name"] == "x"
    with grpc.insecure_channel(daemon.address) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check
        assert (
            check(health_pb2.HealthCheckRequest(service="a")).status == health_pb2.HealthCheckResponse.SERVING
        )
    assert "model loaded" not in {e["event"] for e in events(daemon, "model loaded") if e["model"] == "a"}


def test_round_robin_evicts_the_least_recently_used_idle_model(daemon: RunningDaemon) -> None:
    """a, b, a, c, b in turn all succeed in a budget of the pinned model plus two. The second request for a
    makes it the most recently used, so c evicts b, not a (loaded first); then b evicts a, used before c.
    The pinned model, loaded first of all, is never a candidate."""
    for name in ("a", "b", "a", "c", "b"):
        np.testing.assert_array_equal(infer(daemon, name), np.full(2, 2.0, np.float32))
    assert unloaded(daemon)[:2] == [("b", "evicted for 'c'"), ("a", "evicted for 'b'")]
    rows = index(daemon)
    assert rows["a"] == ("UNAVAILABLE", "evicted for 'b'")
    assert rows["b"][0] == rows["c"][0] == rows["pinned"][0] == "READY"
    assert all(model != "pinned" for model, _ in unloaded(daemon))
    assert metric(daemon, 'mpsd_model_unloads_total{model="b",reason="evicted"}') == 1
    assert metric(daemon, 'mpsd_model_loads_on_demand_total{model="b"}') == 2
    assert metric(daemon, 'mpsd_model_load_wait_seconds_count{model="b"}') == 2
    assert metric(daemon, 'mpsd_model_load_wait_seconds_count{model="a"}') == 1  # its second request: loaded
    assert metric(daemon, 'mpsd_memory_budget_bytes{device="cpu"}') == 301 * MIB
    assert metric(daemon, 'mpsd_memory_resident_bytes{device="cpu"}') == 300 * MIB  # pinned, b, c
    assert metric(daemon, 'mpsd_model_resident{model="a"}') == 0


def test_a_model_with_a_request_in_flight_is_never_evicted(daemon: RunningDaemon) -> None:
    """'big' needs the room of two: with one of them busy, only the idle one could go, which is not enough,
    so 'big' is refused with the figures (naming the busy one) and nothing is evicted for it."""
    infer(daemon, "b")
    infer(daemon, "c")  # resident now: pinned, b, c
    done: queue.Queue[object] = queue.Queue()
    busy = threading.Thread(target=lambda: done.put(infer(daemon, "c", 1000.0)))
    busy.start()
    wait_for(lambda: pending(daemon, "c") > 0, 30, "a request running on c")
    with pytest.raises(InferenceServerException) as err:
        infer(daemon, "big")
    assert err.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
    assert "c (0.10 GiB, in use)" in str(err.value.message()), err.value.message()
    busy.join(30)
    np.testing.assert_array_equal(done.get(timeout=1), np.full(2, 1001.0, np.float32))
    assert not [m for m, reason in unloaded(daemon) if reason == "evicted for 'big'"]
    assert index(daemon)["b"][0] == "READY"


def metric(daemon: RunningDaemon, prefix: str) -> float:
    """The sum of the samples whose line starts with `prefix` (name and labels)."""
    with urllib.request.urlopen(f"http://{daemon.metrics}/metrics", timeout=10) as response:  # type: ignore[attr-defined]
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def pending(daemon: RunningDaemon, name: str) -> float:
    """The model's requests held by the daemon (queued or running), from its pending gauge."""
    return metric(daemon, f'mpsd_inference_pending_request_count{{model="{name}"')


def test_a_model_that_cannot_fit_is_refused_with_the_figures(daemon: RunningDaemon) -> None:
    with pytest.raises(InferenceServerException) as err:
        infer(daemon, "huge")
    assert err.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
    message = str(err.value.message())
    assert "'huge' needs 1.00 GiB on cpu; its budget is 0.29 GiB" in message, message
    assert "pinned (0.10 GiB, pinned)" in message, message
    np.testing.assert_array_equal(infer(daemon, "pinned"), np.full(2, 2.0, np.float32))  # still serving


def test_an_idle_model_is_unloaded_and_the_next_request_loads_it_again(daemon: RunningDaemon) -> None:
    infer(daemon, "idle")
    wait_for(lambda: ("idle", "unloaded after 1 s idle") in unloaded(daemon), 30, "the idle unload")
    assert index(daemon)["idle"] == ("UNAVAILABLE", "unloaded after 1 s idle")
    infer(daemon, "idle")
    assert len([e for e in events(daemon, "model loaded") if e["model"] == "idle"]) == 2


def test_the_idle_sweeper_never_unloads_a_model_with_a_request_in_flight(daemon: RunningDaemon) -> None:
    """'held' (keep-alive 1 s) runs one request until the test lets it end. 'canary' (keep-alive 1 s too),
    loaded once that request runs, is unloaded for being idle first: by then the sweeper has looked at
    'held' more than 1 s after its request began, and must have left it loaded, since it was in use."""
    gate: Path = daemon.gate  # type: ignore[attr-defined]
    done: queue.Queue[object] = queue.Queue()
    busy = threading.Thread(target=lambda: done.put(infer(daemon, "held", 1000.0)))
    busy.start()
    try:
        wait_for((gate / "started").exists, 60, "the request running in 'held'")
        infer(daemon, "canary")
        wait_for(
            lambda: ("canary", "unloaded after 1 s idle") in unloaded(daemon), 30, "canary's idle unload"
        )
        assert index(daemon)["held"] == ("READY", "")
        assert "held" not in [m for m, _ in unloaded(daemon)]
    finally:
        (gate / "release").touch()
        busy.join(30)
    np.testing.assert_array_equal(done.get(timeout=1), np.full(2, 1001.0, np.float32))


def test_concurrent_first_requests_share_one_load(daemon: RunningDaemon) -> None:
    results: queue.Queue[object] = queue.Queue()
    threads = [threading.Thread(target=lambda: results.put(infer(daemon, "shared"))) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results.qsize() == 6
    assert len([e for e in events(daemon, "model loaded") if e["model"] == "shared"]) == 1


def test_a_deadline_that_ends_during_the_load_is_answered_and_leaks_nothing(daemon: RunningDaemon) -> None:
    """The model takes 3 s to load; a request with a 0.5 s timeout gets DEADLINE_EXCEEDED at its deadline,
    the load goes on, and the next request is served; no shared memory is left behind."""
    with pytest.raises(InferenceServerException) as err:
        infer(daemon, "slowload", timeout=500_000)
    assert err.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    assert "was not loaded within" in str(err.value.message())
    np.testing.assert_array_equal(infer(daemon, "slowload"), np.full(2, 2.0, np.float32))
    assert len([e for e in events(daemon, "model loaded") if e["model"] == "slowload"]) == 1
    assert pending(daemon, "slowload") == 0


def test_status_shows_what_each_model_holds(daemon: RunningDaemon) -> None:
    """`mpsd status`: per model resident or not, pinned, footprint and where it comes from; the budget."""

    def status(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "mpsd", "status", *args, "--address", daemon.address],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    rows = {r["model"]: r for r in json.loads(status("--json"))["residency"]}
    assert rows["pinned"]["resident"] and rows["pinned"]["pinned"]
    assert rows["pinned"]["footprint"] == {"cpu": 100 * MIB}
    assert rows["pinned"]["footprint_basis"] == "declared"
    assert rows["huge"]["resident"] is False and rows["huge"]["footprint"] == {"cpu": 1024 * MIB}
    assert rows["huge"]["load"] == "on_demand" and rows["idle"]["keep_alive"] == "1 s"
    assert rows["pinned"]["idle_s"] is not None
    budgets = json.loads(status("--json"))["budgets"]
    assert {"device": "cpu", "budget_bytes": 301 * MIB}.items() <= budgets[0].items()
    text = status()
    assert "RESIDENT" in text and "cpu: " in text and "held of a 301.0 MiB budget" in text


@pytest.fixture(scope="module")
def strict(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    """Room for two 100 MiB models, which may not be evicted within 600 s of their load; at most two
    requests may wait for one model's load."""
    tmp = tmp_path_factory.mktemp("residency-strict")
    repo = tmp / "repo"
    for name in ("x", "y", "z"):
        model(repo, name, 100 * MIB)
    model(repo, "slow", 1)
    (repo / "slow" / "1" / "model.py").write_text(SLOW_INIT)
    config = tmp / "mpsd.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "memory_budget_bytes": {"cpu": 201 * MIB},
                "residency": {"min_residency_s": 600, "load_queue_size": 2},
                "metrics_address": "off",
            }
        )
    )
    with serving(repo, tmp / "daemon.log", config=config) as running:
        yield running


def test_a_model_loaded_less_than_min_residency_ago_is_not_evicted(strict: RunningDaemon) -> None:
    infer(strict, "x")
    infer(strict, "y")
    with pytest.raises(InferenceServerException) as err:
        infer(strict, "z")
    assert err.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
    message = str(err.value.message())
    assert "x (0.10 GiB, loaded" in message and "min_residency_s 600" in message, message
    assert unloaded(strict) == []
    infer(strict, "x")  # still serving


def test_at_most_load_queue_size_requests_wait_for_one_load(strict: RunningDaemon) -> None:
    """Four requests for a model that takes 3 s to load: two wait and are served, two are refused at once."""
    results: queue.Queue[object] = queue.Queue()

    def call() -> None:
        try:
            results.put(infer(strict, "slow"))
        except InferenceServerException as exc:
            results.put(exc)

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    answers = [results.get_nowait() for _ in range(4)]
    refused = [a for a in answers if isinstance(a, InferenceServerException)]
    assert len(refused) == 2, answers
    for exc in refused:
        assert exc.status() == "StatusCode.RESOURCE_EXHAUSTED"
        assert "2 requests already wait for it (load_queue_size 2)" in str(exc.message())


def test_explicit_unload_and_load_work_on_models_that_load_on_demand(strict: RunningDaemon) -> None:
    """RepositoryModelUnload frees the model's room at once; RepositoryModelLoad loads an on-demand model
    now, without a request, admitted under the budget like any load."""
    assert index(strict)["z"][0] == "UNAVAILABLE"
    strict.client.unload_model("x")
    strict.client.load_model("z")
    assert index(strict)["z"][0] == "READY"
    assert strict.client.is_model_ready("z")
    with pytest.raises(InferenceServerException) as err:
        strict.client.load_model("x")  # y and z are young: no room
    assert "min_residency_s 600" in str(err.value.message())


# ---- the per-device memory budget, checked before any worker of a model starts -------------------------


def two_models(repo: Path, fraction: float) -> None:
    # KIND_AUTO on Linux counts against cuda:0 (and runs on the CPU here, where no GPU exists).
    group = [{"kind": "KIND_AUTO", "count": 1, "memory_fraction": fraction}]
    models.add_sub(repo, "first", instance_group=group)
    models.add_sub(repo, "second", instance_group=group)


@pytest.mark.parametrize("policy", ["refuse", "warn"])
def test_fractions_over_one_device(
    tmp_path: Path, start_daemon: Callable[..., RunningDaemon], policy: str
) -> None:
    repo = tmp_path / "repo"
    two_models(repo, 0.6)
    config = tmp_path / "mpsd.yaml"
    config.write_text(yaml.safe_dump({"memory_budget_policy": policy, "metrics_address": ""}))
    daemon = start_daemon(repo, config=config)
    daemon.wait_models_settled()
    rows = {r["name"]: r for r in daemon.client.get_model_repository_index(as_json=True)["models"]}
    if policy == "refuse":
        refused = [r for r in rows.values() if r["state"] == "UNAVAILABLE"]
        assert len(refused) == 1, rows  # the model that would overcommit the device is refused
        reason = refused[0]["reason"]
        assert "memory fractions add up to 1.2" in reason
        assert "first/1" in reason and "second/1" in reason
        assert sum(r["state"] == "READY" for r in rows.values()) == 1
    else:
        assert all(r["state"] == "READY" for r in rows.values()), rows
        assert "memory budget exceeded" in daemon.log()
