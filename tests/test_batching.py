"""Dynamic batching through the real daemon: merged when compatible, never mixed, bounded, deadline-aware."""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml
from tritonclient.utils import InferenceServerException

from tests import models
from tests.conftest import RunningDaemon, free_port, http_request, pending_requests, wait_for

ROWS = """
import json
with open(self.config['parameters']['log'], 'a') as f:
    first = inputs['x'].reshape(-1).tolist()[:1]
    f.write(json.dumps({'rows': int(inputs['x'].shape[0]), 'first': first}) + '\\n')
if float(inputs['x'].max()) >= 1000:
    time.sleep(0.5)
return {'y': inputs['x'] * 2, 'pid': torch.full((inputs['x'].shape[0], 1), os.getpid(), dtype=torch.int64)}
"""


def batched_model(repo: Path, name: str, log: Path, count: int = 1, **batching: object) -> None:
    models.python_model(
        repo,
        name,
        ROWS,
        config={
            "backend": "python",
            "max_batch_size": 8,
            "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [-1]}],
            "output": [
                {"name": "y", "data_type": "TYPE_FP32", "dims": [-1]},
                {"name": "pid", "data_type": "TYPE_INT64", "dims": [1]},
            ],
            "instance_group": [{"kind": "KIND_CPU", "count": count}],
            "dynamic_batching": batching,
            "parameters": {"log": str(log)},
        },
    )


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningDaemon, Path]]:
    tmp = tmp_path_factory.mktemp("batching")
    repo = tmp / "repo"
    batched_model(
        repo, "merge", tmp / "merge.log", max_queue_delay_microseconds=300_000, preferred_batch_size=[4]
    )
    batched_model(repo, "bounded", tmp / "bounded.log", max_queue_size=2)
    batched_model(repo, "pair", tmp / "pair.log", count=2, max_queue_delay_microseconds=20_000)
    config = tmp / "mpsd.yaml"
    metrics = f"127.0.0.1:{free_port()}"
    config.write_text(yaml.safe_dump({"metrics_address": metrics}))
    daemon = RunningDaemon(repo, tmp / "daemon.log", config=config)
    try:
        daemon.wait_ready()
        (tmp / "metrics").write_text(metrics)
        yield daemon, tmp
    finally:
        daemon.stop()
        daemon.kill_group()


def x(values: np.ndarray) -> list[grpcclient.InferInput]:
    inp = grpcclient.InferInput("x", list(values.shape), "FP32")
    inp.set_data_from_numpy(values)
    return [inp]


def fire(
    daemon: RunningDaemon, model: str, arrays: list[np.ndarray], **kwargs: object
) -> list[tuple[object, object]]:
    """Send all requests at once (async) and collect (result, error) in request order."""
    done: queue.Queue[tuple[int, object, object]] = queue.Queue()
    for i, a in enumerate(arrays):
        daemon.client.async_infer(
            model, x(a), callback=lambda result, error, i=i: done.put((i, result, error)), **kwargs
        )
    got = sorted((done.get(timeout=60) for _ in arrays), key=lambda t: t[0])
    return [(r, e) for _, r, e in got]


def executed_rows(log: Path) -> list[int]:
    return [json.loads(line)["rows"] for line in log.read_text().splitlines()] if log.exists() else []


def test_compatible_requests_are_merged_and_split_back(setup: tuple[RunningDaemon, Path]) -> None:
    daemon, tmp = setup
    arrays = [np.full((1, 3), float(i), np.float32) for i in range(8)]
    results = fire(daemon, "merge", arrays)
    for a, (result, error) in zip(arrays, results, strict=True):
        assert error is None, error
        np.testing.assert_array_equal(result.as_numpy("y"), a * 2)  # type: ignore[union-attr]
    rows = executed_rows(tmp / "merge.log")
    assert max(rows) > 1, rows
    stats = daemon.client.get_inference_statistics("merge", as_json=True)["model_stats"][0]
    sizes = {int(b["batch_size"]) for b in stats["batch_stats"]}
    assert any(s > 1 for s in sizes), sizes
    assert int(stats["inference_count"]) >= 8
    assert int(stats["execution_count"]) < int(stats["inference_count"])


def test_incompatible_shapes_are_never_mixed(setup: tuple[RunningDaemon, Path]) -> None:
    daemon, _ = setup
    arrays = [np.full((1, 3 if i % 2 else 5), float(i), np.float32) for i in range(6)]
    for a, (result, error) in zip(arrays, fire(daemon, "merge", arrays), strict=True):
        assert error is None, error
        assert result.as_numpy("y").shape == a.shape  # type: ignore[union-attr]
        np.testing.assert_array_equal(result.as_numpy("y"), a * 2)  # type: ignore[union-attr]


def test_full_queue_is_refused_at_once(setup: tuple[RunningDaemon, Path]) -> None:
    daemon, _ = setup
    arrays = [np.full((1, 2), 1000.0 + i, np.float32) for i in range(8)]  # each takes 0.5 s
    results = fire(daemon, "bounded", arrays)
    refused = [e for _, e in results if e is not None]
    assert refused, "no request was refused"
    for e in refused:
        assert isinstance(e, InferenceServerException)
        assert e.status() == "StatusCode.UNAVAILABLE"  # Triton's code and words
        assert e.message() == "[request id: <id_unknown>] Exceeds maximum queue size"
    assert any(e is None for _, e in results)


def test_expired_request_is_dropped_from_the_queue(setup: tuple[RunningDaemon, Path]) -> None:
    daemon, tmp = setup
    blocker = np.full((1, 2), 1000.0, np.float32)  # occupies the only instance for 0.5 s
    marker = np.full((1, 3), 4242.0, np.float32)  # another shape: never in the blocker's batch
    done: queue.Queue[tuple[str, object, object]] = queue.Queue()
    daemon.client.async_infer(
        "bounded", x(blocker), callback=lambda result, error: done.put(("b", result, error))
    )
    wait_for(lambda: '"first": [1000.0]' in (tmp / "bounded.log").read_text(), 30, "the blocker running")
    daemon.client.async_infer(
        "bounded",
        x(marker),
        callback=lambda result, error: done.put(("m", result, error)),
        client_timeout=0.2,
    )
    got = {k: (r, e) for k, r, e in (done.get(timeout=30) for _ in range(2))}
    assert got["b"][1] is None
    err = got["m"][1]
    assert isinstance(err, InferenceServerException)
    assert err.status() == "StatusCode.DEADLINE_EXCEEDED"
    # Once the blocker finished, the expired request was dropped instead of being run.
    daemon.client.infer("bounded", x(np.zeros((1, 2), np.float32)))
    firsts = [line for line in (tmp / "bounded.log").read_text().splitlines() if "4242" in line]
    assert firsts == []


def test_batches_go_to_free_instances(setup: tuple[RunningDaemon, Path]) -> None:
    daemon, _ = setup
    # 12 requests of 2 rows: at most 4 fit a batch of 8, so several slow batches need both instances.
    arrays = [np.full((2, 2), 1000.0 + i, np.float32) for i in range(12)]
    pids = set()
    for result, error in fire(daemon, "pair", arrays):
        assert error is None, error
        pids.update(int(p) for p in result.as_numpy("pid").reshape(-1))  # type: ignore[union-attr]
    assert len(pids) == 2, pids


def test_a_single_instance_takes_the_next_batch_while_it_runs_one(setup: tuple[RunningDaemon, Path]) -> None:
    """With one instance a full next batch is handed to the worker at once and waits there, in its own
    regions, instead of in the queue: while a slow batch runs, one more request (of another shape, so its
    own batch, and of max_batch_size rows) is accepted beyond `max_queue_size` (2). A short one would wait
    in the queue for company until the running batch ends."""
    daemon, _ = setup
    done: queue.Queue[tuple[int, object, object]] = queue.Queue()
    shapes = [(1, 2), (8, 3), (1, 4), (1, 5), (1, 6)]  # incompatible: one batch each
    metrics = (setup[1] / "metrics").read_text()
    for i, shape in enumerate(shapes):
        daemon.client.async_infer(
            "bounded",
            x(np.full(shape, 1000.0 + i, np.float32)),
            callback=lambda result, error, i=i: done.put((i, result, error)),
        )
        if i < 4:  # in this order: each held by the daemon before the next is sent
            wait_for(lambda i=i: pending_requests(metrics) == i + 1, 30, f"request {i} in the daemon")
    got = sorted((done.get(timeout=60) for _ in shapes), key=lambda t: t[0])
    errors = [e for _, _, e in got]
    # running, waiting in the worker, two in the queue, refused
    assert [e is None for e in errors] == [True, True, True, True, False], errors
    assert (
        isinstance(errors[4], InferenceServerException)
        and errors[4].status() == "StatusCode.UNAVAILABLE"
        and errors[4].message() == "[request id: <id_unknown>] Exceeds maximum queue size"
    )


def _order_of_answers(
    setup: tuple[RunningDaemon, Path], blockers: int, send_marker: Callable[[Callable[..., None]], None]
) -> list[tuple[str, object, object]]:
    """Send `blockers` slow requests to the one instance of 'bounded' (each held by the daemon before the
    next is sent), then the marker through `send_marker(callback)`; every answer in the order it came."""
    daemon, tmp = setup
    metrics = (tmp / "metrics").read_text()
    done: queue.Queue[tuple[str, object, object]] = queue.Queue()
    for i in range(blockers):
        daemon.client.async_infer(
            "bounded",
            x(np.full((1, 2 + i), 1000.0 + i, np.float32)),
            callback=lambda result, error, i=i: done.put((f"b{i}", result, error)),
        )
        wait_for(lambda i=i: pending_requests(metrics) == i + 1, 30, f"blocker {i} in the daemon")
    send_marker(lambda result, error: done.put(("m", result, error)))
    return [done.get(timeout=30) for _ in range(blockers + 1)]


def _marker_expired_first(got: list[tuple[str, object, object]], log: Path, status: str) -> None:
    assert got[0][0] == "m", [k for k, _, _ in got]  # answered at its timeout, not after the blockers
    err = got[0][2]
    assert isinstance(err, InferenceServerException), got[0]
    assert err.status() == status, err
    assert "deadline" in str(err.message()), err
    assert all(e is None for k, _, e in got if k != "m")
    assert "4242" not in log.read_text()  # dropped, never run


def test_a_timeout_parameter_answers_a_request_waiting_in_the_worker_at_once(
    setup: tuple[RunningDaemon, Path],
) -> None:
    """One instance runs a 0.5 s batch; the next request waits in the worker's second seat with a 0.1 s
    `timeout` parameter (microseconds, as tritonclient sends it): it is answered DEADLINE_EXCEEDED at its
    timeout, not once the batch ahead of it is done, and it never runs. It is a full batch (max_batch_size
    rows), so it goes to the worker at once; a short one would wait in the daemon's queue while the batch
    ahead runs. Unit tests of both waits, on virtual time: test_queue."""
    daemon, tmp = setup

    def marker(callback: Callable[..., None]) -> None:
        daemon.client.async_infer(
            "bounded", x(np.full((8, 7), 4242.0, np.float32)), callback=callback, timeout=100_000
        )

    _marker_expired_first(
        _order_of_answers(setup, 1, marker), tmp / "bounded.log", "StatusCode.DEADLINE_EXCEEDED"
    )


def test_a_timeout_parameter_answers_a_queued_request_at_once_over_http(
    setup: tuple[RunningDaemon, Path],
) -> None:
    """The same over HTTP, for a request in the queue (both of the worker's seats are taken): 504 at its
    timeout, while every instance is still busy."""
    daemon, tmp = setup

    def marker(callback: Callable[..., None]) -> None:
        def send() -> None:  # plain http.client: tritonclient.http's clients must not cross threads
            tensor = {"name": "x", "shape": [1, 7], "datatype": "FP32", "data": [4242.0] * 7}
            body = json.dumps({"inputs": [tensor], "parameters": {"timeout": 100_000}}).encode()
            status, answer, _ = http_request(daemon.http_address, "POST", "/v2/models/bounded/infer", body)
            if status == 200:
                callback(answer, None)
            else:
                callback(None, InferenceServerException(answer["error"], status=str(status)))

        threading.Thread(target=send, daemon=True).start()

    _marker_expired_first(_order_of_answers(setup, 2, marker), tmp / "bounded.log", "504")


def test_a_timeout_that_passes_while_the_request_runs_lets_it_finish(
    setup: tuple[RunningDaemon, Path],
) -> None:
    """The timeout bounds the wait for an instance, as Triton's does: a request that started within it
    (the instance was free) runs its 0.5 s to the end and is answered with its result."""
    daemon, _ = setup
    a = np.full((1, 2), 1000.0, np.float32)
    result = daemon.client.infer("bounded", x(a), timeout=100_000)
    np.testing.assert_array_equal(result.as_numpy("y"), a * 2)


def _http_fire(daemon: RunningDaemon, model: str, arrays: list[np.ndarray]) -> list[tuple[int, Any]]:
    """Send every request at once, each on its own HTTP connection, as JSON; (status, body) in request
    order. Plain http.client: tritonclient.http's clients are gevent-bound and must not cross threads."""

    def one(a: np.ndarray) -> tuple[int, Any]:
        tensor = {"name": "x", "shape": list(a.shape), "datatype": "FP32", "data": a.reshape(-1).tolist()}
        body = json.dumps({"inputs": [tensor], "outputs": [{"name": "y"}]}).encode()
        status, answer, _ = http_request(daemon.http_address, "POST", f"/v2/models/{model}/infer", body)
        return status, answer

    with ThreadPoolExecutor(len(arrays)) as pool:
        return list(pool.map(one, arrays))


def test_http_requests_share_the_batching_and_the_queue_limit(setup: tuple[RunningDaemon, Path]) -> None:
    """HTTP requests go through the same queue as gRPC ones: merged into batches, split back, and refused
    with 503 (UNAVAILABLE) and the same message once `max_queue_size` requests wait."""
    daemon, tmp = setup
    arrays = [np.full((1, 3), 7000.0 + i, np.float32) for i in range(4)]
    for a, (status, answer) in zip(arrays, _http_fire(daemon, "merge", arrays), strict=True):
        assert status == 200, answer
        np.testing.assert_array_equal(np.array(answer["outputs"][0]["data"], np.float32), (a * 2).reshape(-1))
    lines = [json.loads(line) for line in (tmp / "merge.log").read_text().splitlines()]
    assert max(line["rows"] for line in lines if 7000 <= line["first"][0] < 7004) > 1, lines

    results = _http_fire(daemon, "bounded", [np.full((1, 2), 1000.0 + i, np.float32) for i in range(8)])
    refused = [answer for status, answer in results if status != 200]
    assert refused, "no request was refused"
    for status, answer in results:
        if status != 200:
            assert status == 503, answer
            assert answer["error"] == "[request id: <id_unknown>] Exceeds maximum queue size"
    assert any(status == 200 for status, _ in results)


def test_queue_time_ends_when_the_worker_starts_the_execution(setup: tuple[RunningDaemon, Path]) -> None:
    """A request handed to a busy worker waits there, behind the execution before it: that wait is queue
    time in ModelStatistics (Triton's queue time ends when the execution starts), not compute time. The
    follower is a full batch, so it goes to the worker at once; a short one would wait in the daemon's
    queue instead, where its time counts as queue time anyway and the worker's wait goes untested."""
    daemon, tmp = setup
    metrics = (tmp / "metrics").read_text()
    wait_for(lambda: pending_requests(metrics) == 0, 30, "the earlier tests' requests to settle")

    def queue_ns() -> int:
        stats = daemon.client.get_inference_statistics("bounded", as_json=True)["model_stats"][0]
        return int(stats["inference_stats"]["queue"].get("ns", 0))

    before = queue_ns()
    done: queue.Queue[tuple[str, object, object]] = queue.Queue()
    daemon.client.async_infer(  # runs for 0.5 s on the only instance
        "bounded",
        x(np.full((1, 2), 1777.0, np.float32)),
        callback=lambda result, error: done.put(("blocker", result, error)),
    )
    wait_for(lambda: '"first": [1777.0]' in (tmp / "bounded.log").read_text(), 30, "the blocker running")
    daemon.client.async_infer(  # another shape, and full (8 rows): sent to the worker at once, waits there
        "bounded",
        x(np.full((8, 3), 1.0, np.float32)),
        callback=lambda result, error: done.put(("follower", result, error)),
    )
    got = {name: error for name, _, error in (done.get(timeout=30) for _ in range(2))}
    assert got == {"blocker": None, "follower": None}
    # The follower waited for most of the blocker's 0.5 s; without that wait both queued for microseconds.
    assert queue_ns() - before > 200_000_000
