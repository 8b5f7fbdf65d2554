"""Hot reload: the repository changes under load and mpsd follows without dropping a request; a repository
given through a symlink is watched too (its real-path events are placed in it: test_watch_symlink.py)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests import models
from tests.conftest import RunningDaemon, free_port, pending_requests, wait_for

DIMS = 4


def write_config_file(tmp: Path, **settings: object) -> Path:
    import yaml

    path = tmp / "mpsd.yaml"
    path.write_text(yaml.safe_dump({"reload_quiet_period_s": 0.3, "metrics_address": "", **settings}))
    return path


def constant_model(repo: Path, name: str = "const", count: int = 1, second_group: bool = False) -> Path:
    groups = [{"kind": "KIND_CPU", "count": count}]
    if second_group:
        groups.append({"kind": "KIND_CPU", "count": 1})
    model_dir = repo / name
    models.write_config(
        model_dir,
        {
            "backend": "torchscript",
            "max_batch_size": 0,
            "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [DIMS]}],
            "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [DIMS]}],
            "instance_group": groups,
        },
    )
    return model_dir


def publish_version(model_dir: Path, version: int, value: float) -> None:
    """Safe publishing: build the version directory aside, then rename it into place."""
    staging = model_dir.parent / f".staging-{model_dir.name}-{version}"
    models.save_torchscript(models.Constant(value), staging / "model.pt")
    os.rename(staging, model_dir / str(version))


def x_input() -> list[grpcclient.InferInput]:
    inp = grpcclient.InferInput("x", [DIMS], "FP32")
    inp.set_data_from_numpy(np.zeros(DIMS, np.float32))
    return [inp]


def served_value(client: grpcclient.InferenceServerClient, model: str = "const") -> float:
    y = client.infer(model, x_input()).as_numpy("y")
    assert len(set(y.tolist())) == 1, f"a response mixes versions: {y}"
    return float(y[0])


# Each load thread's pause between calls: about as long as a call here, so a request is nearly always in
# flight across the threads while the load takes about half the CPU a tight loop would from the tests
# running beside it (the reloads themselves are mostly a new worker's start).
PAUSE_S = 0.002


class Load:
    """Client threads calling a model over and over; records every answer and every error."""

    def __init__(self, address: str, model: str, threads: int = 3) -> None:
        self.values: list[float] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(address, model)) for _ in range(threads)]

    def _run(self, address: str, model: str) -> None:
        client = grpcclient.InferenceServerClient(address)
        try:
            while not self._stop.is_set():
                try:
                    self.values.append(served_value(client, model))
                except (InferenceServerException, AssertionError) as exc:
                    self.errors.append(str(exc))
                self._stop.wait(PAUSE_S)
        finally:
            client.close()

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()


def watch(
    tmp_path: Path, start_daemon: Callable[..., RunningDaemon], **settings: object
) -> tuple[RunningDaemon, Path]:
    repo = tmp_path / "repo"
    repo.mkdir()
    model_dir = constant_model(repo)
    publish_version(model_dir, 1, 1.0)
    daemon = start_daemon(repo, config=write_config_file(tmp_path, model_control="watch", **settings))
    daemon.wait_ready()
    return daemon, model_dir


@pytest.fixture
def watched(tmp_path: Path, start_daemon: Callable[..., RunningDaemon]) -> tuple[RunningDaemon, Path]:
    return watch(tmp_path, start_daemon)


def stopped_workers(daemon: RunningDaemon) -> set[str]:
    """The workers (model/version#instance) the daemon logged as stopped."""
    stopped = set()
    for line in daemon.log().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == "worker stopped":
            stopped.add(str(event.get("worker")))
    return stopped


def test_twenty_weight_updates_under_load_drop_nothing(
    tmp_path: Path, start_daemon: Callable[..., RunningDaemon]
) -> None:
    # Each version is renamed into place whole, so a short quiet period loses nothing: each update is then
    # mostly its new worker's start.
    daemon, model_dir = watch(tmp_path, start_daemon, reload_quiet_period_s=0.05)
    with Load(daemon.address, "const") as load:
        for version in range(2, 22):
            publish_version(model_dir, version, float(version))
            wait_for(
                lambda v=version: served_value(daemon.client) == float(v),  # type: ignore[misc]
                120,
                lambda v=version: f"version {v} serving\n{daemon.log()[-3000:]}",  # type: ignore[misc]
            )
        # The last replaced version retires under load too.
        wait_for(lambda: "const/20#0" in stopped_workers(daemon), 60, "version 20's worker stopped")
    assert load.errors == []
    assert len(load.values) > 20
    assert set(load.values) <= {float(v) for v in range(1, 22)}
    assert served_value(daemon.client) == 21.0
    meta = daemon.client.get_model_metadata("const", as_json=True)
    assert meta["versions"] == ["21"]


def test_broken_updates_keep_the_old_version_serving(watched: tuple[RunningDaemon, Path]) -> None:
    daemon, model_dir = watched
    config = model_dir / "config.yaml"
    good = config.read_text()

    def index_reason() -> str:
        rows = daemon.client.get_model_repository_index(as_json=True)["models"]
        return " ".join(r.get("reason", "") for r in rows if r["name"] == "const")

    with Load(daemon.address, "const") as load:
        config.write_text(good + "\ninput: [unclosed\n")
        wait_for(lambda: "invalid YAML" in index_reason(), 60, "YAML error in the index")
        assert served_value(daemon.client) == 1.0
        config.write_text(good)
        wait_for(lambda: index_reason() == "", 60, "fixed YAML picked up")

        # A new version whose model raises while loading.
        broken = model_dir.parent / ".staging-broken"
        broken.mkdir()
        (broken / "model.pt").write_bytes(b"this is not a TorchScript archive")
        os.rename(broken, model_dir / "2")
        wait_for(lambda: "model.pt" in index_reason() or "Error" in index_reason(), 60, "load failure reason")
        assert served_value(daemon.client) == 1.0
        # Fixing the files later is picked up like any other change.
        shutil.rmtree(model_dir / "2")
        publish_version(model_dir, 2, 2.0)
        wait_for(lambda: served_value(daemon.client) == 2.0, 120, "fixed version serving")
    assert load.errors == []
    assert "update failed" in daemon.log()


def test_half_written_version_waits_for_its_files_to_settle(
    tmp_path: Path, start_daemon: Callable[..., RunningDaemon]
) -> None:
    """The quiet period's promise: a version whose file is still being written is not attempted (no failed
    load, a deferral instead) and is loaded once, after the writes stop. Without the quiet period the first
    file event loads the truncated file and the log says "update failed"."""
    repo = tmp_path / "repo"
    repo.mkdir()
    model_dir = constant_model(repo)
    publish_version(model_dir, 1, 1.0)
    # A quiet period far longer than the pauses between writes, so a slow machine cannot open a gap.
    config = write_config_file(tmp_path, model_control="watch", reload_quiet_period_s=3.0)
    daemon = start_daemon(repo, config=config)
    daemon.wait_ready()
    started = len(daemon.log())
    aside = model_dir.parent / "aside.pt"
    models.save_torchscript(models.Constant(7.0), aside)
    payload = aside.read_bytes()
    target = model_dir / "2"
    target.mkdir()
    with Load(daemon.address, "const") as load, open(target / "model.pt", "wb") as out:
        # Copy the file slowly, the way a large download or a network copy arrives.
        step = max(1, len(payload) // 8)
        for offset in range(0, len(payload), step):
            out.write(payload[offset : offset + step])
            out.flush()
            if offset == 0:  # a reconcile now (SIGHUP) finds the file still changing, and defers it
                daemon.proc.send_signal(signal.SIGHUP)
                wait_for(lambda: "load deferred" in daemon.log(), 30, "the change deferred")
            time.sleep(0.1)
    with Load(daemon.address, "const") as load2:
        wait_for(
            lambda: served_value(daemon.client) == 7.0, 120, f"copied version serving\n{daemon.log()[-2000:]}"
        )
    assert load.errors == [] and load2.errors == []
    text = daemon.log()[started:]
    assert "update failed" not in text
    loads = [line for line in text.splitlines() if "loading model" in line and "unloading" not in line]
    assert len(loads) == 1, loads  # the new version, once


def test_removed_model_finishes_in_flight_requests(
    tmp_path: Path, start_daemon: Callable[..., RunningDaemon]
) -> None:
    repo = tmp_path / "repo"
    models.python_model(
        repo,
        "slow",
        """
        if float(inputs['x'].sum()) > 0:
            time.sleep(2.0)
        return {'y': inputs['x']}
        """,
    )
    models.add_sub(repo, "stays")
    metrics = f"127.0.0.1:{free_port()}"
    config = write_config_file(tmp_path, model_control="watch", metrics_address=metrics)
    daemon = start_daemon(repo, config=config)
    daemon.wait_ready()
    slow_pid = daemon.started_workers("slow")[-1]
    results: list[object] = []

    def call() -> None:
        client = grpcclient.InferenceServerClient(daemon.address)
        inp = grpcclient.InferInput("x", [2], "FP32")
        inp.set_data_from_numpy(np.ones(2, np.float32))
        try:
            results.append(client.infer("slow", [inp]).as_numpy("y").tolist())
        except InferenceServerException as exc:
            results.append(exc)
        finally:
            client.close()

    threads = [threading.Thread(target=call) for _ in range(2)]
    for t in threads:
        t.start()
    wait_for(lambda: pending_requests(metrics) == 2, 30, "both requests in the daemon")
    shutil.move(str(repo / "slow"), str(tmp_path / "slow-removed"))

    def gone() -> bool:
        try:
            daemon.client.get_model_metadata("slow")
        except InferenceServerException as exc:
            return exc.status() == "StatusCode.NOT_FOUND"
        return False

    wait_for(gone, 30, "model removed from routing")
    for t in threads:
        t.join()
    assert results == [[1.0, 1.0], [1.0, 1.0]]
    wait_for(
        lambda: not psutil.pid_exists(slow_pid) or psutil.Process(slow_pid).status() == "zombie",
        30,
        "worker exited",
    )
    assert daemon.client.is_model_ready("stays")


def test_instance_count_change_keeps_the_running_instance(
    tmp_path: Path, start_daemon: Callable[..., RunningDaemon]
) -> None:
    repo = tmp_path / "repo"
    model_dir = constant_model(repo, count=1)
    publish_version(model_dir, 1, 1.0)
    daemon = start_daemon(repo, config=write_config_file(tmp_path, model_control="watch"))
    daemon.wait_ready()
    (first,) = daemon.started_workers("const")
    with Load(daemon.address, "const") as load:
        constant_model(repo, count=2)
        wait_for(lambda: len(daemon.started_workers("const")) == 2, 60, "second instance started")
        wait_for(lambda: "instance count changed" in daemon.log(), 30, "resize logged")
    assert psutil.pid_exists(first)
    assert first in daemon.worker_pids()
    assert load.errors == []
    assert served_value(daemon.client) == 1.0


def test_a_count_change_that_renumbers_instances_replaces_the_version_side_by_side(
    tmp_path: Path, start_daemon: Callable[..., RunningDaemon]
) -> None:
    """Growing the first of two groups renumbers the second group's instance: the running instances are
    not kept by number (they would end up in the wrong group) but replaced, with no request lost."""
    repo = tmp_path / "repo"
    model_dir = constant_model(repo, count=1, second_group=True)
    publish_version(model_dir, 1, 1.0)
    daemon = start_daemon(repo, config=write_config_file(tmp_path, model_control="watch"))
    daemon.wait_ready()
    before = set(daemon.started_workers("const"))
    assert len(before) == 2
    with Load(daemon.address, "const") as load:
        constant_model(repo, count=2, second_group=True)
        # Three workers start at once here, beside the rest of the suite: up to two minutes on 2 busy cores.
        wait_for(lambda: len(daemon.started_workers("const")) == 5, 120, "a new set of three instances")
        wait_for(lambda: not before & set(daemon.worker_pids()), 60, "the old instances retired")
    assert "instance count changed" not in daemon.log()
    assert load.errors == []
    assert served_value(daemon.client) == 1.0


def test_sighup_and_repository_load_trigger_the_same_reconcile(
    tmp_path: Path, start_daemon: Callable[..., RunningDaemon]
) -> None:
    repo = tmp_path / "repo"
    model_dir = constant_model(repo)
    publish_version(model_dir, 1, 1.0)
    daemon = start_daemon(repo, config=write_config_file(tmp_path, model_control="explicit"))
    daemon.wait_ready()
    publish_version(model_dir, 2, 2.0)
    assert served_value(daemon.client) == 1.0
    os.kill(daemon.pid, signal.SIGHUP)
    wait_for(lambda: served_value(daemon.client) == 2.0, 60, "SIGHUP reconcile")
    # Explicit mode: files alone change nothing, since no watcher runs (one would have said so at its start,
    # long before this reconcile).
    assert "watching repository" not in daemon.log()
    publish_version(model_dir, 3, 3.0)
    daemon.client.load_model("const")
    assert served_value(daemon.client) == 3.0
    assert daemon.log().count("reconciled repository") >= 2


def test_ignored_names_trigger_nothing_and_a_failed_model_waits_for_its_files(
    tmp_path: Path, start_daemon: Callable[..., RunningDaemon]
) -> None:
    """docs/hot-reload.md: changes to ignored names trigger nothing; a model that failed to load is not
    retried by a reconcile until its files change. docs/daemon-config.md: a config file that no longer
    parses at SIGHUP is logged and the running settings are kept."""
    repo = tmp_path / "repo"
    model_dir = constant_model(repo)
    publish_version(model_dir, 1, 1.0)
    models.python_model(repo, "broken", "raise ValueError('broken on purpose')")
    config = write_config_file(tmp_path, model_control="watch", log_level="debug")
    daemon = start_daemon(repo, config=config)
    daemon.wait_models_settled()
    assert not daemon.client.is_model_ready("broken")
    assert len(daemon.started_workers("broken")) == 1
    changed = daemon.log().count('"event": "repository changed"')

    (model_dir / ".notes").write_text("x")
    (model_dir / "config.yaml.swp").write_text("x")
    (model_dir / "1" / "model.pt.part").write_text("x")
    (model_dir / "__pycache__").mkdir()
    (model_dir / "__pycache__" / "m.pyc").write_text("x")
    (repo / ".staging").mkdir()
    (repo / "upload.tmp").mkdir()
    (repo / "backup~").write_text("x")
    # A change the watcher must see, after the ignored ones: the events up to it name only that one.
    (repo / "sentinel.txt").write_text("x")
    wait_for(lambda: daemon.log().count('"event": "repository changed"') > changed, 60, "the sentinel seen")
    events = [json.loads(line) for line in daemon.log().splitlines() if line.startswith("{")]
    seen = [e for e in events if e["event"] == "repository changed"][changed:]
    assert {name for event in seen for name in event["models"]} == {"sentinel.txt"}

    reload = subprocess.run(
        [sys.executable, "-m", "mpsd", "reload", "--address", daemon.address], capture_output=True, text=True
    )
    assert reload.returncode == 0, reload.stderr
    assert len(daemon.started_workers("broken")) == 1  # unchanged files: not retried
    assert len(daemon.started_workers("const")) == 1  # and the served model left alone

    config.write_text("log_level: [unclosed\n")
    os.kill(daemon.pid, signal.SIGHUP)
    wait_for(lambda: "config not reloaded" in daemon.log(), 30, "the parse error logged")
    settings = daemon.client.get_log_settings(as_json=True)["settings"]
    assert settings["log_verbose_level"]["uint32_param"] >= 1  # still debug
    assert served_value(daemon.client) == 1.0

    models.python_model(repo, "broken", "return {'y': inputs['x']}")  # fixed: a change, so retried
    wait_for(
        lambda: daemon.client.is_model_ready("broken"), 60, f"the fixed model ready\n{daemon.log()[-2000:]}"
    )
    assert len(daemon.started_workers("broken")) == 2


def test_triggers_during_a_reconcile_coalesce_into_one_more_run() -> None:
    """docs/hot-reload.md: only one reconcile runs at a time, and triggers that arrive meanwhile are merged
    into one more run."""
    import asyncio
    from types import SimpleNamespace

    from mpsd.daemon.core.reconcile import Reconciler

    async def scenario() -> tuple[int, int]:
        release = asyncio.Event()
        calls, running, most = 0, 0, 0

        async def reconcile(only: object, wait_quiet: bool) -> SimpleNamespace:
            nonlocal calls, running, most
            calls += 1
            running += 1
            most = max(most, running)
            await release.wait()
            await asyncio.sleep(0.01)  # a reconcile takes time (and yields, whatever the loop does)
            running -= 1
            return SimpleNamespace(deferred=[])

        registry = SimpleNamespace(reconcile=reconcile, quiet_period_s=0.0)
        reconciler = Reconciler(registry)  # type: ignore[arg-type]
        loop = asyncio.create_task(reconciler.run_forever())
        reconciler.wake("first")
        await asyncio.sleep(0.05)
        for i in range(5):  # while the first one runs
            reconciler.wake(f"more {i}")
            await asyncio.sleep(0)
        release.set()
        await asyncio.sleep(0.1)
        loop.cancel()
        return calls, most

    assert asyncio.run(asyncio.wait_for(scenario(), 30)) == (2, 1)


def test_a_model_added_to_a_symlinked_repository_after_start_is_loaded(start_daemon, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    real = tmp_path / "real"
    models.add_sub(real, name="first", dims=4)
    link = tmp_path / "link"
    link.symlink_to(real)
    config = tmp_path / "mpsd.yaml"
    config.write_text("reload_quiet_period_s: 0.3\nmetrics_address: ''\n")
    daemon: RunningDaemon = start_daemon(link, config=config)
    daemon.wait_ready()
    staging = tmp_path / "staging"
    models.add_sub(staging, name="second", dims=4)
    os.rename(staging / "second", real / "second")
    wait_for(lambda: daemon.client.is_model_ready("second"), 120, f"the added model to load\n{daemon.log()}")
    assert "repository watcher stopped" not in daemon.log()
