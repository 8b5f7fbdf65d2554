"""Worker and daemon deaths: a request in flight on a killed worker fails with a clear reason, the worker
comes back, and no process or shared-memory segment outlives the daemon."""

from __future__ import annotations

import os
import queue
import signal
from pathlib import Path

import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests import models
from tests.conftest import RunningDaemon, own_segments, shm_segments, wait_for


def sleepy_model(repo: Path, marker: Path, count: int = 1) -> None:
    """`y = x + 1`; a positive sum (never the warm-up's zeros) first touches `marker`, then sleeps 3 s."""
    models.python_model(
        repo,
        "sleepy",
        f"""
        if float(inputs['x'].sum()) > 0:
            open({str(marker)!r}, 'w').close()
            time.sleep(3)
        return {{'y': inputs['x'] + 1}}
        """,
        config={
            "backend": "python",
            "max_batch_size": 0,
            "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [-1]}],
            "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [-1]}],
            "instance_group": [{"kind": "KIND_CPU", "count": count}],
        },
    )


def x_input(value: np.ndarray) -> list[grpcclient.InferInput]:
    inp = grpcclient.InferInput("x", list(value.shape), "FP32")
    inp.set_data_from_numpy(value)
    return [inp]


def alive(proc: psutil.Process) -> bool:
    """Running and not a zombie (an unreaped child of a reaper that never reaps still counts as gone)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_worker_killed_during_a_request(start_daemon, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    repo = tmp_path / "repo"
    marker = tmp_path / "computing"
    sleepy_model(repo, marker)
    # A longer first restart delay keeps the "restarting" window wide enough to observe.
    config = tmp_path / "mpsd.yaml"
    config.write_text("restart_backoff_initial_s: 2.0\n")
    before = shm_segments()
    d: RunningDaemon = start_daemon(repo, config=config)
    d.wait_ready()
    [old_pid] = d.worker_pids()
    old_worker = psutil.Process(old_pid)

    results: queue.Queue[tuple[object, object]] = queue.Queue()
    d.client.async_infer(
        "sleepy", x_input(np.ones(4, np.float32)), callback=lambda result, error: results.put((result, error))
    )
    wait_for(marker.exists, 30, "the request to reach the worker")
    os.kill(old_pid, signal.SIGKILL)

    result, error = results.get(timeout=30)
    assert result is None
    assert isinstance(error, InferenceServerException)
    assert error.status() == "StatusCode.UNAVAILABLE", error.message()
    message = error.message()
    assert "model 'sleepy'" in message
    assert f"pid {old_pid}" in message
    assert "killed by signal 9 (SIGKILL)" in message

    # Not ready while the worker restarts, with the reason in the index; requests are refused meanwhile.
    def restarting_row() -> dict[str, str] | None:
        rows = d.client.get_model_repository_index(as_json=True)["models"]
        row = next(r for r in rows if r["name"] == "sleepy")
        return row if row.get("state") == "UNAVAILABLE" else None

    row = wait_for(restarting_row, 30, "the model to become unavailable")
    assert "killed by signal 9 (SIGKILL)" in row.get("reason", ""), row
    assert not d.client.is_model_ready("sleepy")
    assert not d.client.is_server_ready()
    with pytest.raises(InferenceServerException) as refused:
        d.client.infer("sleepy", x_input(-np.ones(4, np.float32)))
    assert refused.value.status() == "StatusCode.UNAVAILABLE"
    assert "not ready" in refused.value.message() and "SIGKILL" in refused.value.message()

    wait_for(lambda: d.client.is_model_ready("sleepy"), 60, f"the worker to come back\n{d.log()}")
    [new_pid] = d.worker_pids()
    assert new_pid != old_pid
    assert not alive(old_worker)
    assert d.client.is_server_ready()
    for i in range(3):
        x = -np.arange(i + 3, dtype=np.float32)
        np.testing.assert_array_equal(d.client.infer("sleepy", x_input(x)).as_numpy("y"), x + 1)
    index = d.client.get_model_repository_index(as_json=True)["models"]
    assert [(m["name"], m["state"]) for m in index] == [("sleepy", "READY")]

    assert own_segments(d) == set(), "shared memory of finished requests is still linked"
    assert d.stop() == 0
    assert {s for s in shm_segments() - before if s.startswith(f"mpsd-{d.pid}-")} == set()


@pytest.fixture
def two_workers(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    sleepy_model(repo, tmp_path / "computing", count=2)
    return repo


def test_sigterm_stops_every_worker(start_daemon, two_workers: Path) -> None:  # type: ignore[no-untyped-def]
    before = shm_segments()
    d: RunningDaemon = start_daemon(two_workers)
    d.wait_ready()
    workers = [psutil.Process(pid) for pid in d.worker_pids()]
    assert len(workers) == 2
    np.testing.assert_array_equal(d.client.infer("sleepy", x_input(-np.ones(2, np.float32))).as_numpy("y"), 0)
    assert d.stop() == 0
    assert [w.pid for w in workers if alive(w)] == []
    assert {s for s in shm_segments() - before if s.startswith(f"mpsd-{d.pid}-")} == set()
    assert "Traceback" not in d.log()


def test_workers_exit_when_the_daemon_is_killed(start_daemon, two_workers: Path) -> None:  # type: ignore[no-untyped-def]
    d: RunningDaemon = start_daemon(two_workers)
    d.wait_ready()
    workers = [psutil.Process(pid) for pid in d.worker_pids()]
    assert len(workers) == 2
    os.kill(d.pid, signal.SIGKILL)
    assert d.proc.wait(30) == -signal.SIGKILL
    wait_for(lambda: not any(alive(w) for w in workers), 15, "the orphaned workers to exit")
