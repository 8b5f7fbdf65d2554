"""Client cancellation, closed streams and stale leftovers of a dead daemon."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
import yaml
from tritonclient.utils import InferenceServerException

from mpsd import osfacts
from tests import models
from tests.conftest import RunningDaemon, free_port, pending_requests, wait_for

SLOW = """
value = float(inputs['x'].reshape(-1)[0])
with open(self.config['parameters']['log'], 'a') as f:
    f.write(f'{value:.0f}\\n')
if value > 0:
    time.sleep(1.5)
return {'y': inputs['x']}
"""


def x(value: float) -> list[grpcclient.InferInput]:
    inp = grpcclient.InferInput("x", [1], "FP32")
    inp.set_data_from_numpy(np.array([value], np.float32))
    return [inp]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningDaemon, Path, str]]:
    tmp = tmp_path_factory.mktemp("cancel")
    repo = tmp / "repo"
    log = tmp / "ran.log"
    models.python_model(
        repo,
        "slow",
        SLOW,
        config={
            "backend": "python",
            "max_batch_size": 0,
            "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [1]}],
            "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [1]}],
            "parameters": {"log": str(log)},
        },
    )
    metrics = f"127.0.0.1:{free_port()}"
    config = tmp / "mpsd.yaml"
    config.write_text(yaml.safe_dump({"metrics_address": metrics}))
    daemon = RunningDaemon(repo, tmp / "daemon.log", config=config)
    try:
        daemon.wait_ready()
        yield daemon, log, metrics
    finally:
        daemon.stop()
        daemon.kill_group()


def ran(log: Path) -> list[str]:
    return log.read_text().split() if log.exists() else []


def test_cancelled_request_is_dropped_from_the_queue(setup: tuple[RunningDaemon, Path, str]) -> None:
    daemon, log, metrics = setup
    done: queue.Queue[object] = queue.Queue()
    daemon.client.async_infer("slow", x(1000), callback=lambda result, error: done.put(error))
    wait_for(lambda: ran(log)[-1:] == ["1000"], 30, "the blocker running")
    call = daemon.client.async_infer("slow", x(4242), callback=lambda result, error: done.put(error))
    # Cancel only once the daemon holds the request (pending beside the blocker): a cancel that lands
    # before would test nothing.
    wait_for(lambda: pending_requests(metrics) == 2, 30, "the second request pending")
    call.cancel()
    assert done.get(timeout=30) is not None  # the cancelled call reports its cancellation first
    assert done.get(timeout=30) is None  # then the blocker completes
    daemon.client.infer("slow", x(0))
    assert "4242" not in ran(log)
    wait_for(lambda: pending_requests(metrics) == 0, 10, "no pending request left")


def test_an_http_request_whose_client_disconnects_is_dropped_from_the_queue(
    setup: tuple[RunningDaemon, Path, str],
) -> None:
    """HTTP has no cancel message: a client that closes its connection cancels its request, as on gRPC."""
    import json
    import socket

    daemon, log, metrics = setup
    done: queue.Queue[object] = queue.Queue()
    daemon.client.async_infer("slow", x(1001), callback=lambda result, error: done.put(error))
    wait_for(lambda: ran(log)[-1:] == ["1001"], 30, "the blocker running")
    body = json.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [4343]}]}).encode()
    host, _, port = daemon.http_address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        head = f"POST /v2/models/slow/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
        sock.sendall(head.encode() + body)
        wait_for(lambda: pending_requests(metrics) == 2, 30, "the HTTP request pending")
    wait_for(lambda: pending_requests(metrics) == 1, 30, "the HTTP request dropped")
    assert done.get(timeout=30) is None  # the blocker completes
    daemon.client.infer("slow", x(0))
    assert "4343" not in ran(log)


def test_a_stream_closed_by_the_client_frees_its_requests(setup: tuple[RunningDaemon, Path, str]) -> None:
    daemon, log, metrics = setup
    client = grpcclient.InferenceServerClient(daemon.address)
    client.start_stream(callback=lambda result, error: None)
    for marker in (7001, 7002, 7003):
        client.async_stream_infer("slow", x(marker))
    wait_for(lambda: "7001" in ran(log) and pending_requests(metrics) == 3, 30, "one running, two queued")
    client.stop_stream(cancel_requests=True)
    client.close()
    wait_for(lambda: pending_requests(metrics) == 0, 10, "stream's requests released")
    # Requests run in order: had the stream's queued requests been kept, they would run before this one.
    assert daemon.client.infer("slow", x(0)).as_numpy("y").tolist() == [0.0]
    assert "7002" not in ran(log) and "7003" not in ran(log)
    assert ran(log)[-1] == "0"


def test_a_request_abandoned_while_it_runs_does_not_disturb_the_next(
    setup: tuple[RunningDaemon, Path, str],
) -> None:
    """When the client gives up while its request runs, the worker still finishes it; the next request waits
    for that before it reuses the shared memory, then gets its own answer (not the abandoned one's)."""
    daemon, log, metrics = setup
    done: queue.Queue[InferenceServerException | None] = queue.Queue()
    call = daemon.client.async_infer("slow", x(5151), callback=lambda result, error: done.put(error))
    wait_for(lambda: ran(log)[-1:] == ["5151"], 30, "the request running in the worker")
    call.cancel()  # the client gives up while the model runs it
    error = done.get(timeout=30)
    assert error is not None and error.status() == "StatusCode.CANCELLED"
    t0 = time.monotonic()
    answer = daemon.client.infer("slow", x(-3)).as_numpy("y").tolist()
    assert answer == [-3.0]
    assert time.monotonic() - t0 > 0.5, "the next request waited for the abandoned one to finish"
    assert ran(log)[-2:] == ["5151", "-3"]
    wait_for(lambda: pending_requests(metrics) == 0, 10, "nothing left pending")


def _dead_pid() -> int:
    pid = 4_000_000
    while psutil.pid_exists(pid):
        pid += 1
    return pid


def test_next_start_removes_shared_memory_left_by_a_dead_daemon(
    tmp_path: Path, start_daemon: Callable[..., RunningDaemon]
) -> None:
    """Any daemon starting on the host removes a dead daemon's segments, so one that another test's daemon
    started meanwhile may take first: then the start is tried again with another segment."""
    shm_dir = osfacts.current().shm_dir
    if shm_dir is None:
        pytest.skip(f"{osfacts.current().name} lists shared memory in no folder, where a stale one would be")
    repo = tmp_path / "repo"
    models.add_sub(repo)
    for attempt in range(3):
        stale = Path(shm_dir) / f"mpsd-{_dead_pid() + attempt}-0"
        stale.write_bytes(b"\0" * 4096)
        daemon = start_daemon(repo)
        daemon.wait_live()
        wait_for(lambda stale=stale: not stale.exists(), 30, "stale segment removed")  # type: ignore[misc]
        # What a start removed is told once the daemon listens (a refused start says only why).
        wait_for(lambda daemon=daemon: '"event": "listening"' in daemon.log(), 30, "listening")  # type: ignore[misc]
        removed = [line for line in daemon.log().splitlines() if "removed stale shared memory" in line]
        if any(stale.name in line for line in removed):
            return
        daemon.stop()
    raise AssertionError("three starts, and another daemon removed the segment before each of them")
