"""`mpsd tune` against a real daemon on loopback (the search logic itself: test_tune_search.py): it runs a
short search and reports each trial, loads each trial's settings without writing the repository and
without failing another client's requests, loads the repository's config again at the end, writes the
chosen values only with --write, and refuses the trials the memory budget has no room for."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml

from tests import models
from tests.conftest import ROOT, RunningDaemon, serving

MIB = 1 << 20
FAST = ["--duration", "0.3", "--warmup", "0.1", "--concurrency", "4", "--min-gain", "0"]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    base = tmp_path_factory.mktemp("tune")
    repo = base / "repo"
    group = [{"kind": "KIND_CPU", "count": 1}]
    models.add_sub(
        repo,
        "add_sub",
        dynamic_batching={"max_queue_delay_microseconds": 0},
        instance_group=group,
        residency={"footprint_bytes": 10 * MIB},
    )
    # Waits 8 ms for 8 rows that 4 clients never send: any trial without the delay beats it.
    models.add_sub(
        repo,
        "slow_start",
        dynamic_batching={"max_queue_delay_microseconds": 8000},
        instance_group=group,
        residency={"footprint_bytes": 10 * MIB},
    )
    models.add_sub(repo, "tight", instance_group=group, residency={"footprint_bytes": 300 * MIB})
    models.add_sub(
        repo, "keep", instance_group=group, residency={"footprint_bytes": 500 * MIB, "pinned": True}
    )
    config = base / "mpsd.yaml"
    # Room for everything once (830 MiB) and for add_sub's trials, not for a second copy of `tight`.
    config.write_text(yaml.safe_dump({"memory_budget_bytes": {"cpu": 1000 * MIB}}))
    with serving(repo, base / "daemon.log", config=config) as running:
        yield running


def tune(daemon: RunningDaemon, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "mpsd", "tune", *args, "--address", daemon.address, *FAST]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)


def tree_digest(directory: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            digest.update(str(path.relative_to(directory)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def trial_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if re.match(r"\s*\d+  instances=", line)]


def override_loads(daemon: RunningDaemon, model: str) -> int:
    count = 0
    for line in daemon.log().splitlines():
        if line.startswith("{"):
            event = json.loads(line)
            if event.get("event", "").startswith("loading model with the request's config"):
                count += event.get("model") == model
    return count


def served(daemon: RunningDaemon, model: str) -> dict[str, Any]:
    config: dict[str, Any] = daemon.client.get_model_config(model, as_json=True)["config"]
    return config


class Caller:
    """Another client calling the model the whole time, counting what succeeds and what fails."""

    def __init__(self, daemon: RunningDaemon, model: str) -> None:
        self.client = grpcclient.InferenceServerClient(daemon.address)
        self.model = model
        self.ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        inputs = []
        for name in ("INPUT0", "INPUT1"):
            tensor = grpcclient.InferInput(name, [1, 16], "FP32")
            tensor.set_data_from_numpy(np.ones((1, 16), np.float32))
            inputs.append(tensor)
        while not self._stop.is_set():
            try:
                self.client.infer(self.model, inputs, client_timeout=60)
                self.ok += 1
            except Exception as exc:
                self.failures.append(str(exc))

    def __enter__(self) -> Caller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.client.close()


def test_tune_reports_trials_restores_the_config_and_never_fails_another_client(
    daemon: RunningDaemon,
) -> None:
    before = tree_digest(daemon.repo)
    original = served(daemon, "add_sub")
    with Caller(daemon, "add_sub") as caller:
        done = tune(daemon, "add_sub", "--max-instances", "2", "--delays", "0,500")
        calls_during_tune = caller.ok
    assert done.returncode == 0, done.stdout + done.stderr
    lines = trial_lines(done.stdout)
    assert lines[0].split()[:4] == ["0", "instances=1", "batch=8", "delay=0us"], done.stdout
    assert len(lines) >= 4, done.stdout
    assert all(re.search(r"\d+\.\d+ +\d+\.\d+ +\d+\.\d+", line) for line in lines), done.stdout
    assert re.search(r"^best: instances=\d", done.stdout, re.M), done.stdout
    assert "not written" in done.stdout
    # each trial was loaded with the request's config while the other client kept calling: none failed
    assert override_loads(daemon, "add_sub") >= len(lines) - 1
    assert caller.failures == [] and calls_during_tune > 0
    assert tree_digest(daemon.repo) == before
    restored = served(daemon, "add_sub")
    assert restored["instance_group"][0]["count"] == original["instance_group"][0]["count"]
    assert restored["max_batch_size"] == original["max_batch_size"]
    assert restored.get("dynamic_batching") == original.get("dynamic_batching")


def test_write_puts_the_best_settings_in_the_model_config(daemon: RunningDaemon) -> None:
    path = daemon.repo / "slow_start" / "config.yaml"
    done = tune(
        daemon,
        "slow_start",
        "--max-instances",
        "1",
        "--delays",
        "0,8000",
        "--write",
        "--repository",
        str(daemon.repo),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    best = re.search(
        r"^best: instances=(\d+) batch=(\d+) delay=(\d+)us(?: preferred=(\d+))?$", done.stdout, re.M
    )
    assert best is not None, done.stdout
    assert f"wrote {path}" in done.stdout
    written = yaml.safe_load(path.read_text())
    assert written["instance_group"][0]["count"] == int(best[1])
    assert written["max_batch_size"] == int(best[2])
    assert written["dynamic_batching"]["max_queue_delay_microseconds"] == int(best[3])
    assert written["dynamic_batching"].get("preferred_batch_size", []) == ([int(best[4])] if best[4] else [])
    assert written["input"][0]["name"] == "INPUT0"  # the rest as it was


def test_trials_the_budget_has_no_room_for_are_refused_and_nothing_is_evicted(daemon: RunningDaemon) -> None:
    done = tune(daemon, "tight", "--max-instances", "2", "--delays", "0")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = trial_lines(done.stdout)
    assert len(lines) > 1 and all("refused: needs about" in line for line in lines[1:]), done.stdout
    assert "best: instances=1 batch=8 delay=0us" in done.stdout
    assert override_loads(daemon, "tight") == 0
    assert daemon.client.is_model_ready("keep")
    assert '"model unloaded"' not in daemon.log()
