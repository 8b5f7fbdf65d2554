"""Decoupled models through the real daemon: responses streamed as the model yields them, over gRPC
(the stock tritonclient's stream API) and HTTP server-sent events; cancellation, deadlines and a worker
killed mid-stream.

The model writes a line to its log for every response it produces and when its generator closes, so the
tests see what the model did, not only what the client got.
"""

from __future__ import annotations

import asyncio
import http.client
import itertools
import json
import os
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from mpsd.daemon.dataplane.request import InferResult
from mpsd.daemon.dataplane.streaming import ResponseStream
from tests import models
from tests.conftest import RunningDaemon, free_port, own_segments, serving, wait_for

GENERATE = """
n, delay, tag = int(inputs['n'][0]), int(inputs['delay_ms'][0]) / 1000, int(inputs['tag'][0])
log = open(self.config['parameters']['log'], 'a', buffering=1)
i = -1
try:
    for i in range(n):
        if delay:
            time.sleep(delay)
        log.write(f"{tag} produced {i} {time.time()}\\n")
        pid = torch.tensor([os.getpid()], dtype=torch.int64)
        yield {'i': torch.tensor([i], dtype=torch.int64), 'pid': pid}
finally:
    log.write(f"{tag} closed {i} {time.time()}\\n")
    log.close()
"""
ECHO = "return {'i': inputs['n'], 'pid': torch.tensor([os.getpid()], dtype=torch.int64)}"


def config(log: Path, decoupled: bool, count: int = 1) -> dict[str, Any]:
    scalar = {"data_type": "TYPE_INT64", "dims": [1]}
    return {
        "backend": "python",
        "max_batch_size": 0,
        "input": [{"name": name, **scalar} for name in ("n", "delay_ms", "tag")],
        "output": [{"name": "i", **scalar}, {"name": "pid", **scalar}],
        "instance_group": [{"kind": "KIND_CPU", "count": count}],
        "model_transaction_policy": {"decoupled": decoupled},
        "parameters": {"log": str(log)},
    }


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningDaemon, Path]]:
    tmp = tmp_path_factory.mktemp("streaming")
    repo = tmp / "repo"
    log = tmp / "model.log"
    models.python_model(repo, "gen", GENERATE, config=config(log, True, count=2))
    models.python_model(repo, "plain", ECHO, config=config(log, False))
    settings = tmp / "mpsd.yaml"
    metrics = f"127.0.0.1:{free_port()}"
    settings.write_text(f"metrics_address: {metrics}\n")
    with serving(repo, tmp / "daemon.log", config=settings) as daemon:
        daemon.metrics = metrics  # type: ignore[attr-defined]
        yield daemon, log


def responses_sent(daemon: RunningDaemon) -> float:
    with urllib.request.urlopen(f"http://{daemon.metrics}/metrics", timeout=10) as reply:  # type: ignore[attr-defined]
        text = reply.read().decode()
    prefix = 'mpsd_inference_responses_total{model="gen",version="1"}'
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix))


def inputs(n: int, delay_ms: int = 0, tag: int = 0) -> list[grpcclient.InferInput]:
    made = []
    for name, value in (("n", n), ("delay_ms", delay_ms), ("tag", tag)):
        x = grpcclient.InferInput(name, [1], "INT64")
        x.set_data_from_numpy(np.array([value], np.int64))
        made.append(x)
    return made


def model_log(log: Path, tag: int) -> list[tuple[str, int, float]]:
    """(what, index, time) of the model's lines for `tag`."""
    lines = log.read_text().splitlines() if log.exists() else []
    return [(w, int(i), float(t)) for t_, w, i, t in (line.split() for line in lines) if int(t_) == tag]


class Stream:
    """A tritonclient stream whose results land in a queue with the time they arrived."""

    def __init__(self, daemon: RunningDaemon, **kwargs: Any) -> None:
        self.client = grpcclient.InferenceServerClient(daemon.address)
        self.got: queue.Queue[tuple[float, Any, Any]] = queue.Queue()
        self.client.start_stream(
            callback=lambda result, error: self.got.put((time.time(), result, error)), **kwargs
        )

    def send(self, model: str, n: int, delay_ms: int = 0, tag: int = 0, final: bool = True) -> None:
        self.client.async_stream_infer(
            model, inputs(n, delay_ms, tag), request_id=str(tag), enable_empty_final_response=final
        )

    def next(self, timeout: float = 30) -> tuple[float, Any, Any]:
        return self.got.get(timeout=timeout)

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def workers_ready(daemon: RunningDaemon, model: str) -> bool:
    """Every worker of the model is ready (a killed one has been restarted), from `mpsd status`."""
    done = subprocess.run(
        [sys.executable, "-m", "mpsd", "status", "--json", "--address", daemon.address],
        capture_output=True,
        text=True,
        timeout=60,
    )
    workers = [w for w in json.loads(done.stdout)["workers"] if w["model"] == model]
    return bool(workers) and all(w["state"] == "ready" for w in workers)


def final(result: Any) -> bool:
    return bool(result.get_response().parameters["triton_final_response"].bool_param)


def test_each_response_arrives_before_the_next_is_produced(setup: tuple[RunningDaemon, Path]) -> None:
    daemon, log = setup
    sent_before = responses_sent(daemon)
    stream = Stream(daemon)
    try:
        stream.send("gen", 4, delay_ms=300, tag=1)
        arrived = []
        for k in range(4):
            at, result, error = stream.next()
            assert error is None, error
            assert int(result.as_numpy("i")[0]) == k and not final(result)
            assert result.get_response().id == "1"
            arrived.append(at)
        _, last, error = stream.next()
        assert error is None and final(last) and last.as_numpy("i") is None  # the empty final response
    finally:
        stream.close()
    produced = [t for what, _, t in model_log(log, 1) if what == "produced"]
    assert len(produced) == 4
    for k in range(3):
        assert arrived[k] < produced[k + 1], (arrived, produced)
    assert responses_sent(daemon) == sent_before + 4  # each response counts


@pytest.mark.parametrize("limit", [2, None])
def test_a_slow_client_holds_the_model_back(limit: int | None) -> None:
    """Past UNSENT_LIMIT responses the client has not taken (docs/api.md: 8 by default), handing on the next
    waits (and with it the worker's acknowledgement, so the model is not resumed); a client gone makes it
    say stop."""

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        stream, done = (
            (ResponseStream() if limit is None else ResponseStream(limit=limit)),
            loop.create_future(),
        )
        result = InferResult("m", 1, ())
        for _ in range(8 if limit is None else limit):
            assert await stream.deliver(result, done)
        third = asyncio.ensure_future(stream.deliver(result, done))
        for _ in range(10):  # let the loop run: nothing takes a response, so the next stays pending
            await asyncio.sleep(0)
        assert not third.done()
        responses = stream.responses(done)
        await responses.__anext__()  # the client takes one
        assert await third is True
        done.cancel()  # the client goes away
        assert await stream.deliver(result, done) is False

    asyncio.run(scenario())


def test_two_requests_on_one_stream_interleave_and_ordinary_models_still_answer(
    setup: tuple[RunningDaemon, Path],
) -> None:
    daemon, _ = setup
    stream = Stream(daemon)
    try:
        stream.send("gen", 3, delay_ms=200, tag=2)
        stream.send("gen", 3, delay_ms=200, tag=3)
        stream.send("plain", 7, tag=4)
        order = []
        while len([o for o in order if o[1]]) < 2:  # until both final responses
            _, result, error = stream.next()
            assert error is None, error
            rid = result.get_response().id
            if rid == "4":
                assert int(result.as_numpy("i")[0]) == 7
                continue
            order.append((rid, final(result)))
    finally:
        stream.close()
    ids = [rid for rid, is_final in order if not is_final]
    assert sorted(ids) == ["2", "2", "2", "3", "3", "3"]
    switches = sum(a != b for a, b in itertools.pairwise(ids))
    assert switches >= 3, ids  # interleaved as produced, not one request's responses after the other's


def test_unary_infer_of_a_decoupled_model_is_refused(setup: tuple[RunningDaemon, Path]) -> None:
    daemon, _ = setup
    with pytest.raises(InferenceServerException) as err:
        daemon.client.infer("gen", inputs(1))
    assert err.value.status() == "StatusCode.UNIMPLEMENTED"
    assert "ModelStreamInfer" in str(err.value.message())


def test_cancelling_the_stream_stops_the_generator(setup: tuple[RunningDaemon, Path]) -> None:
    daemon, log = setup
    stream = Stream(daemon)
    try:
        stream.send("gen", 50, delay_ms=100, tag=5)
        for _ in range(2):
            assert stream.next()[2] is None
    finally:
        stream.close(cancel=True)
    wait_for(lambda: any(w == "closed" for w, _, _ in model_log(log, 5)), 30, "the generator closed")
    produced = [i for w, i, _ in model_log(log, 5) if w == "produced"]
    assert len(produced) < 50, produced


def test_a_deadline_mid_stream_ends_it_and_closes_the_generator(setup: tuple[RunningDaemon, Path]) -> None:
    daemon, log = setup
    stream = Stream(daemon, stream_timeout=1.5)
    try:
        stream.send("gen", 50, delay_ms=200, tag=6)
        errors = []
        while not errors:
            _, _, error = stream.next()
            if error is not None:
                errors.append(error)
        assert "DEADLINE_EXCEEDED" in str(errors[0].status())
    finally:
        stream.close()
    wait_for(lambda: any(w == "closed" for w, _, _ in model_log(log, 6)), 30, "the generator closed")
    assert len([w for w, _, _ in model_log(log, 6) if w == "produced"]) < 50


def test_a_worker_killed_mid_stream_gives_an_in_band_error_and_the_model_recovers(
    setup: tuple[RunningDaemon, Path],
) -> None:
    daemon, _ = setup
    stream = Stream(daemon)
    try:
        stream.send("gen", 100, delay_ms=100, tag=7)
        _, result, error = stream.next()
        assert error is None
        os.kill(int(result.as_numpy("pid")[0]), signal.SIGKILL)
        while True:
            _, result, error = stream.next()
            if error is not None:
                break
            assert not final(result)
        assert "worker" in str(error.message()).lower(), error
    finally:
        stream.close()
    wait_for(lambda: workers_ready(daemon, "gen"), 60, "every worker ready again")
    again = Stream(daemon)
    try:
        again.send("gen", 2, tag=8)
        got = [again.next() for _ in range(3)]
        assert all(e is None for _, _, e in got) and final(got[2][1])
    finally:
        again.close()


def test_server_sent_events_arrive_one_by_one_and_a_disconnect_stops_the_model(
    setup: tuple[RunningDaemon, Path],
) -> None:
    daemon, log = setup
    host, _, port = daemon.http_address.rpartition(":")

    connections: list[http.client.HTTPConnection] = []

    def open_stream(n: int, tag: int) -> http.client.HTTPResponse:
        connection = http.client.HTTPConnection(host, int(port), timeout=30)
        connections.append(connection)
        body = json.dumps({"n": n, "delay_ms": 300, "tag": tag, "id": f"sse{tag}"})
        connection.request("POST", "/v2/models/gen/generate_stream", body=body)
        response = connection.getresponse()
        assert response.status == 200
        assert response.getheader("Content-Type") == "text/event-stream"
        return response

    try:
        sse_checks(open_stream, connections, log)
    finally:
        for connection in connections:
            connection.close()


def sse_checks(open_stream: Any, connections: list[http.client.HTTPConnection], log: Path) -> None:
    response = open_stream(3, 9)
    events, arrived = [], []
    while len(events) < 3:
        line = response.readline().decode()
        if line.startswith("data: "):
            events.append(json.loads(line[len("data: ") :]))
            arrived.append(time.time())
    response.close()
    assert [e["i"] for e in events] == [0, 1, 2] and events[0]["id"] == "sse9"
    produced = [t for w, _, t in model_log(log, 9) if w == "produced"]
    assert arrived[0] < produced[1] and arrived[1] < produced[2]

    response = open_stream(50, 10)
    while not response.readline().startswith(b"data: "):
        pass
    response.close()
    connections[-1].close()  # the client goes away
    wait_for(lambda: any(w == "closed" for w, _, _ in model_log(log, 10)), 30, "the generator closed")
    assert len([w for w, _, _ in model_log(log, 10) if w == "produced"]) < 50


def test_soak_of_concurrent_streams_with_cancels_and_a_worker_kill(setup: tuple[RunningDaemon, Path]) -> None:
    """16 streams of 100 responses each, some cancelled at random and one worker killed: every request ends
    in its final response or an error, no response is lost or repeated, and the daemon's memory and
    shared memory stay flat."""
    daemon, _ = setup
    wait_for(lambda: workers_ready(daemon, "gen"), 60, "every worker ready")
    rng = random.Random(7)
    process = psutil.Process(daemon.pid)
    rss_before = process.memory_info().rss
    outcome: dict[int, str] = {}
    messages: dict[int, str] = {}
    failures: list[BaseException] = []
    killed = threading.Event()

    def one(tag: int, cancel_at: int | None) -> None:
        try:
            run(tag, cancel_at)
        except BaseException as exc:
            failures.append(exc)

    def run(tag: int, cancel_at: int | None) -> None:
        stream = Stream(daemon)
        seen: list[int] = []
        try:
            stream.send("gen", 100, delay_ms=5, tag=tag)
            while True:
                _, result, error = stream.next(60)
                if error is not None:
                    outcome[tag] = "error"
                    messages[tag] = str(error)
                    break
                if final(result):
                    outcome[tag] = "done"
                    break
                seen.append(int(result.as_numpy("i")[0]))
                if tag == 100 and len(seen) == 20 and not killed.is_set():
                    killed.set()
                    os.kill(int(result.as_numpy("pid")[0]), signal.SIGKILL)
                if cancel_at is not None and len(seen) == cancel_at:
                    outcome[tag] = "cancelled"
                    break
        finally:
            stream.close(cancel=outcome.get(tag) == "cancelled")
        assert seen == list(range(len(seen))), seen  # nothing lost, nothing repeated, in order
        if outcome[tag] == "done":
            assert len(seen) == 100

    tags = list(range(100, 116))
    cancels = {tag: (rng.randint(1, 99) if rng.random() < 0.3 and tag != 100 else None) for tag in tags}
    threads = [threading.Thread(target=one, args=(tag, cancels[tag])) for tag in tags]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not failures, failures
    assert sorted(outcome) == tags, outcome
    assert killed.is_set() and outcome[100] == "error"
    assert "done" in outcome.values(), messages
    wait_for(lambda: daemon.client.is_model_ready("gen"), 60, "the model ready again")
    assert process.memory_info().rss - rss_before < 64 * 2**20
    # Each of the two workers holds at most an input and an output region per seat (SEATS = 2); the killed
    # worker's regions must be gone, not kept beside its successor's.
    assert len(own_segments(daemon)) <= 2 * 2 * 2, sorted(own_segments(daemon))


def test_the_documented_example_model_streams_its_tokens(tmp_path: Path) -> None:
    """docs/configuration.md's decoupled example, served as written: five tokens, one event each."""
    doc = (Path(__file__).parent.parent / "docs" / "configuration.md").read_text()
    blocks = {
        match.group(2).splitlines()[0]: match.group(2)
        for match in re.finditer(r"```(python|yaml)\n(.*?)```", doc, re.S)
        if "models/tokens/" in match.group(2).splitlines()[0]
    }
    repo = tmp_path / "repo"
    (repo / "tokens" / "1").mkdir(parents=True)
    [model_py] = [text for first, text in blocks.items() if first.startswith("# models/tokens/1/model.py")]
    (repo / "tokens" / "1" / "model.py").write_text(model_py)
    (repo / "tokens" / "config.yaml").write_text(blocks["# models/tokens/config.yaml"])
    with serving(repo, tmp_path / "daemon.log", config=_no_metrics(tmp_path)) as daemon:
        host, _, port = daemon.http_address.rpartition(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=60)
        try:
            body = json.dumps({"prompt": [3, 1, 4], "max_tokens": 5})
            connection.request("POST", "/v2/models/tokens/generate_stream", body=body)
            response = connection.getresponse()
            assert response.status == 200
            lines = response.read().splitlines()
            events = [json.loads(line[len(b"data: ") :]) for line in lines if line.startswith(b"data: ")]
        finally:
            connection.close()
    assert len(events) == 5
    assert all(isinstance(e["token"], int) and 0 <= e["token"] < 64 for e in events)


def _no_metrics(tmp: Path) -> Path:
    config = tmp / "mpsd.yaml"
    config.write_text("metrics_address: off\n")
    return config
