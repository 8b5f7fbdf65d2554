"""Python models that call other models, through the real daemon with the stock tritonclient as the outer
client: two calls in flight at once (the called models log when they run), a decoupled model's responses
as a stream, the calling request's deadline and cancellation reaching its calls (the called model logs
that it was stopped, the caller that its next call failed at once), a model calling itself and a cycle of
calls refused instead of waiting for ever, and the called model's errors surfacing with a client's status
and message; a decoupled model streams the responses of a decoupled model it calls."""

from __future__ import annotations

import json
import queue
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests import models
from tests.conftest import RunningDaemon, serving, wait_for

F = {"data_type": "TYPE_FP32", "dims": [-1]}
TWO = {"data_type": "TYPE_FP32", "dims": [2]}
ONE = {"data_type": "TYPE_FP32", "dims": [1]}

HEAD = """
import asyncio, json, time
import torch


def note(config, *entry):
    with open(config['parameters']['log'], 'a') as log:
        log.write(json.dumps([config['name'], *entry, time.time()]) + '\\n')
"""
# A called model: sleeps, then answers x times its factor; logs when it ran.
SCALE = """
class Model:
    def __init__(self, config, device):
        self.config = config

    def infer(self, inputs):
        start = time.time()
        time.sleep(float(self.config['parameters']['sleep']))
        if float(inputs['x'].sum()) < 0:
            raise ValueError('negative input')
        note(self.config, 'ran', start)
        return {'y': inputs['x'] * float(self.config['parameters']['factor'])}
"""
# Calls double and triple at once, from a plain infer or from an async one.
FANOUT = """
class Model:
    def __init__(self, config, device, models):
        self.models = models

    def infer(self, inputs):
        a = self.models.infer_async('double', {'x': inputs['x']})
        b = self.models.infer_async('triple', {'x': inputs['x']})
        return {'y': a.result()['y'] + b.result()['y']}
"""
FANOUT_ASYNC = """
class Model:
    def __init__(self, config, device, models):
        self.models = models

    async def infer(self, inputs):
        a, b = await asyncio.gather(
            self.models.infer_async('double', {'x': inputs['x']}),
            self.models.infer_async('triple', {'x': inputs['x']}),
        )
        return {'y': a['y'] + b['y']}
"""
# Decoupled: x = [n, tag] -> n responses 0..n-1, one every 50 ms; logs its start and how it ended.
COUNTER = """
class Model:
    def __init__(self, config, device):
        self.config = config

    def infer(self, inputs):
        n, tag = (int(v) for v in inputs['x'].tolist())
        note(self.config, tag, 'started')
        sent = 0
        try:
            for i in range(n):
                time.sleep(0.05)
                yield {'y': torch.tensor([float(i)])}
                sent += 1
            note(self.config, tag, 'finished', sent)
        finally:
            if sent < n:
                note(self.config, tag, 'stopped', sent)
"""
# Streams counter's responses; when the stream fails, logs its status and the status of one more call.
STREAMER = """
class Model:
    def __init__(self, config, device, models):
        self.config = config
        self.models = models

    def infer(self, inputs):
        tag = int(inputs['x'][1])
        total, count = 0.0, 0
        try:
            for response in self.models.stream('counter', {'x': inputs['x']}):
                total += float(response['y'][0])
                count += 1
        except Exception as exc:
            try:
                self.models.infer('double', {'x': torch.ones(1)})
                after, why = 'OK', ''
            except Exception as again:
                after, why = again.code.value, again.message
            note(self.config, tag, 'failed', exc.code.value, after, why)
            raise
        return {'total': torch.tensor([total]), 'count': torch.tensor([float(count)])}
"""
# Decoupled too: each of counter's responses, doubled, as it comes (an async generator, awaiting the stream).
FORWARD = """
class Model:
    def __init__(self, config, device, models):
        self.models = models

    async def infer(self, inputs):
        async for response in self.models.stream('counter', {'x': inputs['x']}):
            yield {'y': response['y'] * 2}
"""
# Calls the model its `target` parameter names (itself, or the other of a pair).
BOUNCE = """
class Model:
    def __init__(self, config, device, models):
        self.models = models
        self.target = config['parameters']['target']

    def infer(self, inputs):
        return {'y': self.models.infer(self.target, {'x': inputs['x']})['y']}
"""
# Calls the model named by its TARGET input with x, raising whatever the call raises.
RELAY = """
class Model:
    def __init__(self, config, device, models):
        self.models = models

    def infer(self, inputs):
        target = inputs['TARGET'][0].decode()
        return {'y': self.models.infer(target, {'x': inputs['x']})['y']}
"""


def _model(repo: Path, name: str, source: str, config: dict[str, Any]) -> None:
    models.write_config(repo / name, {"backend": "python", "max_batch_size": 0, **config})
    (repo / name / "1").mkdir(parents=True, exist_ok=True)
    (repo / name / "1" / "model.py").write_text(HEAD + textwrap.dedent(source))


@pytest.fixture(scope="module")
def log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("calls") / "runs.log"


@pytest.fixture(scope="module")
def daemon(log: Path) -> Iterator[RunningDaemon]:
    repo = log.parent / "repo"
    io = {"input": [{"name": "x", **F}], "output": [{"name": "y", **F}]}
    for name, factor in (("double", 2), ("triple", 3)):
        params = {"log": str(log), "factor": str(factor), "sleep": "0.4"}
        _model(repo, name, SCALE, {**io, "parameters": params})
    _model(repo, "pair", SCALE, {**io, "input": [{"name": "x", **TWO}], "parameters": params})
    _model(repo, "fanout", FANOUT, io)
    _model(repo, "fanout_async", FANOUT_ASYNC, io)
    _model(
        repo,
        "counter",
        COUNTER,
        {
            "input": [{"name": "x", **TWO}],
            "output": [{"name": "y", **ONE}],
            "model_transaction_policy": {"decoupled": True},
            "parameters": {"log": str(log)},
        },
    )
    _model(
        repo,
        "streamer",
        STREAMER,
        {
            "input": [{"name": "x", **TWO}],
            "output": [{"name": "total", **ONE}, {"name": "count", **ONE}],
            "parameters": {"log": str(log)},
        },
    )
    _model(
        repo,
        "forward",
        FORWARD,
        {
            "input": [{"name": "x", **TWO}],
            "output": [{"name": "y", **ONE}],
            "model_transaction_policy": {"decoupled": True},
        },
    )
    for name, target in (("selfish", "selfish"), ("ping", "pong"), ("pong", "ping")):
        _model(repo, name, BOUNCE, {**io, "parameters": {"target": target}})
    relay_inputs = [{"name": "x", **F}, {"name": "TARGET", "data_type": "TYPE_STRING", "dims": [1]}]
    _model(repo, "relay", RELAY, {**io, "input": relay_inputs})
    with serving(repo, log.parent / "daemon.log") as running:
        yield running


def _entries(log: Path, name: str) -> list[list[Any]]:
    if not log.exists():
        return []
    return [e for e in map(json.loads, log.read_text().splitlines()) if e[0] == name]


def _x(*values: float) -> grpcclient.InferInput:
    x = grpcclient.InferInput("x", [len(values)], "FP32")
    x.set_data_from_numpy(np.array(values, dtype=np.float32))
    return x


@pytest.mark.parametrize("model", ["fanout", "fanout_async"])
def test_two_calls_run_at_once(daemon: RunningDaemon, log: Path, model: str) -> None:
    before = time.time()
    result = daemon.client.infer(model, [_x(1.0, 2.0)])
    np.testing.assert_array_equal(result.as_numpy("y"), [5.0, 10.0])
    ran = {e[0]: (e[2], e[3]) for n in ("double", "triple") for e in _entries(log, n) if e[2] >= before}
    assert set(ran) == {"double", "triple"}, ran
    (start_a, end_a), (start_b, end_b) = ran["double"], ran["triple"]
    assert start_a < end_b and start_b < end_a, f"the calls ran one after the other: {ran}"


def test_calls_from_http(daemon: RunningDaemon) -> None:
    client = httpclient.InferenceServerClient(daemon.http_address)
    x = httpclient.InferInput("x", [3], "FP32")
    x.set_data_from_numpy(np.array([1.0, 0.0, -0.5], dtype=np.float32))
    np.testing.assert_array_equal(client.infer("fanout", [x]).as_numpy("y"), [5.0, 0.0, -2.5])
    client.close()


def test_stream_from_a_decoupled_model(daemon: RunningDaemon, log: Path) -> None:
    result = daemon.client.infer("streamer", [_x(6, 1)])
    assert result.as_numpy("count").tolist() == [6.0]
    assert result.as_numpy("total").tolist() == [15.0]  # 0 + 1 + ... + 5
    assert [e[2:-1] for e in _entries(log, "counter") if e[1] == 1] == [["started"], ["finished", 6]]


def test_a_decoupled_model_streams_the_stream_it_calls(daemon: RunningDaemon, log: Path) -> None:
    """Streaming through a pipeline: a decoupled python model yields each response of the decoupled model
    it calls, to its own client's stream."""
    responses: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(daemon.address)
    client.start_stream(callback=lambda result, error: responses.put(error or result))
    try:
        client.async_stream_infer("forward", [_x(5, 4)], enable_empty_final_response=True)
        got = []
        while (response := responses.get(timeout=30)).as_numpy("y") is not None:
            got.append(response.as_numpy("y").tolist())
    finally:
        client.stop_stream(cancel_requests=True)  # without waiting for a stream that does not end
        client.close()
    assert got == [[0.0], [2.0], [4.0], [6.0], [8.0]]
    assert [e[2:-1] for e in _entries(log, "counter") if e[1] == 4] == [["started"], ["finished", 5]]


def _failure(call: Any) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as caught:
        call()
    return caught.value


def test_deadline_reaches_the_calls(daemon: RunningDaemon, log: Path) -> None:
    """The outer request's `timeout` (its deadline) ends the stream it reads: the called model is stopped
    before its 50 responses, and the caller's next call fails before it is made (`double` never runs)."""
    doubled = len(_entries(log, "double"))
    error = _failure(lambda: daemon.client.infer("streamer", [_x(50, 2)], timeout=600_000))
    assert error.status() == "StatusCode.DEADLINE_EXCEEDED", error
    assert "the deadline of the request to model 'streamer' passed" in error.message()
    stopped = wait_for(lambda: [e for e in _entries(log, "counter") if e[1:3] == [2, "stopped"]], 10, "stop")
    assert stopped[0][3] < 50
    failed = wait_for(lambda: [e for e in _entries(log, "streamer") if e[1:3] == [2, "failed"]], 10, "failed")
    assert failed[0][3:5] == ["DEADLINE_EXCEEDED", "DEADLINE_EXCEEDED"], failed
    assert failed[0][5].endswith("passed before it was made"), failed
    assert len(_entries(log, "double")) == doubled


def test_cancellation_reaches_the_calls(daemon: RunningDaemon, log: Path) -> None:
    """A client that goes away: the stream its request reads stops the called model, and the caller's
    next call fails before it is made (`double` never runs)."""
    doubled = len(_entries(log, "double"))
    call = daemon.client.async_infer("streamer", [_x(400, 3)], lambda result, error: None)
    wait_for(lambda: [e for e in _entries(log, "counter") if e[1:3] == [3, "started"]], 30, "the stream")
    call.cancel()
    stopped = wait_for(lambda: [e for e in _entries(log, "counter") if e[1:3] == [3, "stopped"]], 10, "stop")
    assert stopped[0][3] < 400
    failed = wait_for(lambda: [e for e in _entries(log, "streamer") if e[1:3] == [3, "failed"]], 10, "failed")
    assert failed[0][3:5] == ["CANCELLED", "CANCELLED"], failed
    assert failed[0][5] == "the request to model 'streamer' that made this call was cancelled", failed
    assert len(_entries(log, "double")) == doubled


def test_a_model_calling_itself_is_refused(daemon: RunningDaemon) -> None:
    error = _failure(lambda: daemon.client.infer("selfish", [_x(1.0)], client_timeout=30))
    assert error.status() == "StatusCode.FAILED_PRECONDITION", error
    assert "model 'selfish' version 1 called itself" in error.message()


def test_a_cycle_of_calls_is_refused(daemon: RunningDaemon) -> None:
    error = _failure(lambda: daemon.client.infer("ping", [_x(1.0)], client_timeout=30))
    assert error.status() == "StatusCode.FAILED_PRECONDITION", error
    refused = "model 'pong' version 1 called model 'ping' version 1, which its request came through"
    assert refused in error.message()


def _relay(target: str, x: grpcclient.InferInput) -> list[grpcclient.InferInput]:
    name = grpcclient.InferInput("TARGET", [1], "BYTES")
    name.set_data_from_numpy(np.array([target.encode()], dtype=np.object_))
    return [x, name]


@pytest.mark.parametrize(
    ("target", "values", "status"),
    [
        ("nope", (1.0,), "NOT_FOUND"),  # not in the repository
        ("double", (-1.0,), "INTERNAL"),  # the model raises
        ("pair", (1.0, 2.0, 3.0), "INVALID_ARGUMENT"),  # dims [2]
        ("counter", (1.0, 2.0), "UNIMPLEMENTED"),  # decoupled: a stream, not infer
    ],
)
def test_errors_of_the_called_model_surface(
    daemon: RunningDaemon, target: str, values: tuple[float, ...], status: str
) -> None:
    """A call fails with the status and message a client calling the model gets; uncaught, it fails the
    calling request with them."""
    error = _failure(lambda: daemon.client.infer("relay", _relay(target, _x(*values))))
    assert error.status() == f"StatusCode.{status}", error
    if target != "counter":  # a client gets ModelStreamInfer's hint, a model models.stream's
        direct = _failure(lambda: daemon.client.infer(target, [_x(*values)]))
        assert (error.status(), error.message()) == (direct.status(), direct.message())
