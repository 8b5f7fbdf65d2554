"""Every source of requests is traced and cached alike, through one real daemon (traces to a real OTLP/gRPC
receiver, `tests/test_tracing.py`'s): the answers are the same with tracing on and off whatever the source
(gRPC, HTTP, /generate, OpenAI's embeddings, an ensemble, a python model's call), toggled with Triton's
trace-setting RPC; /generate, /generate_stream, OpenAI's embeddings and chat, and a model's call each make
their spans under the request that caused them; and an ensemble's step and a model's call are answered
from the response cache as a client's request is."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import models, openai_models
from tests.conftest import RunningDaemon, serving
from tests.test_tracing import (
    STAGES,
    Receiver,
    attributes,
    check_request_trace,
    receiver,  # noqa: F401  (the module's OTLP receiver, a fixture)
    traceparent,
    wait_named,
    wait_trace,
)

F4 = {"data_type": "TYPE_FP32", "dims": [4]}
IO = {
    "backend": "python",
    "max_batch_size": 0,
    "input": [{"name": "x", **F4}],
    "output": [{"name": "y", **F4}],
}
CALLER = """
class Model:
    def __init__(self, config, device, models):
        self.models = models
        self.called = config['parameters']['called']

    def infer(self, inputs):
        return {'y': self.models.infer(self.called, {'x': inputs['x']})['y'] + 1}
"""


def _caller(repo: Path, name: str, called: str) -> None:
    models.write_config(repo / name, {**IO, "parameters": {"called": called}})
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text("import torch\n" + CALLER)


def _ensemble(repo: Path, name: str, steps: list[str]) -> None:
    """An ensemble of python models of `x` -> `y`, each step reading the one before."""
    tensors = ["X", *(f"t{i}" for i in range(1, len(steps))), "Y"]
    models.write_config(
        repo / name,
        {
            "backend": "ensemble",
            "max_batch_size": 0,
            "input": [{"name": "X", **F4}],
            "output": [{"name": "Y", **F4}],
            "ensemble_scheduling": {
                "step": [
                    {"model_name": m, "input_map": {"x": tensors[i]}, "output_map": {"y": tensors[i + 1]}}
                    for i, m in enumerate(steps)
                ]
            },
        },
    )
    (repo / name / "1").mkdir()


@pytest.fixture(scope="module")
def daemon(
    tmp_path_factory: pytest.TempPathFactory,
    receiver: tuple[Receiver, int],  # noqa: F811
) -> Iterator[RunningDaemon]:
    tmp = tmp_path_factory.mktemp("trace-sources")
    repo = tmp / "repo"
    cached = {"response_cache": {"enable": True}}
    models.python_model(repo, "double", "return {'y': inputs['x'] * 2}", config=IO)
    models.python_model(repo, "plus_one", "return {'y': inputs['x'] + 1}", config=IO)
    for name in ("cached_step", "cached_called"):
        models.python_model(repo, name, "return {'y': inputs['x'] * 3}", config={**IO, **cached})
    _ensemble(repo, "pipeline", ["double", "plus_one"])
    _ensemble(repo, "cached_pipeline", ["cached_step", "plus_one"])
    _caller(repo, "caller", "double")
    _caller(repo, "cached_caller", "cached_called")
    openai_models.byte_counts(repo, "embed")
    openai_models.generator(repo, "chat", "chat", tmp / "words.log")
    trace = {
        "level": ["TIMESTAMPS"],
        "rate": 0,  # only requests that carry a traceparent, unless a test says otherwise
        "protocol": "grpc",
        "endpoint": f"127.0.0.1:{receiver[1]}",
        "bsp_schedule_delay_ms": 50,
    }
    config = tmp / "mpsd.yaml"
    config.write_text(
        yaml.safe_dump({"trace": trace, "metrics_address": "off", "response_cache_bytes": 1 << 20})
    )
    with serving(repo, tmp / "daemon.log", config=config) as running:
        yield running


@pytest.fixture
def cleared(daemon: RunningDaemon) -> Iterator[None]:
    """The global trace settings back to the config's after the test."""
    yield
    cleared = {"trace_level": None, "trace_rate": None, "trace_count": None}
    daemon.client.update_trace_settings(settings=cleared)


def _x(values: np.ndarray, module: Any = grpcclient, name: str = "x") -> Any:
    tensor = module.InferInput(name, [4], "FP32")
    tensor.set_data_from_numpy(values)
    return tensor


def _post(daemon: RunningDaemon, path: str, body: dict[str, Any], headers: dict[str, str]) -> bytes:
    request = urllib.request.Request(
        f"http://{daemon.http_address}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **headers},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.read()  # type: ignore[no-any-return]


def answers(daemon: RunningDaemon, values: np.ndarray, text: str, headers: dict[str, str]) -> dict[str, Any]:
    """Each source's answer to the same request."""
    client = daemon.client
    http = httpclient.InferenceServerClient(daemon.http_address)
    try:
        over_http = http.infer("double", [_x(values, httpclient)], headers=dict(headers)).as_numpy("y")
    finally:
        http.close()
    generated = json.loads(_post(daemon, "/v2/models/double/generate", {"x": values.tolist()}, headers))
    embedded = json.loads(_post(daemon, "/v1/embeddings", {"model": "embed", "input": [text]}, headers))
    return {
        "grpc": client.infer("double", [_x(values)], headers=headers).as_numpy("y").tolist(),
        "http": over_http.tolist(),
        "generate": generated["y"],
        "embeddings": [row["embedding"] for row in embedded["data"]],
        "ensemble": client.infer("pipeline", [_x(values, name="X")], headers=headers).as_numpy("Y").tolist(),
        "call": client.infer("caller", [_x(values)], headers=headers).as_numpy("y").tolist(),
    }


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    values=st.lists(st.floats(-1e6, 1e6, width=32), min_size=4, max_size=4).map(
        lambda v: np.array(v, dtype=np.float32)
    ),
    text=st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=20),
)
def test_answers_are_the_same_with_tracing_on_and_off_whatever_the_source(
    daemon: RunningDaemon, cleared: None, values: np.ndarray, text: str
) -> None:
    client = daemon.client
    client.update_trace_settings(settings={"trace_level": ["OFF"]})
    off = answers(daemon, values, text, {})
    client.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"], "trace_rate": "1"})
    header, _, _ = traceparent()
    on = answers(daemon, values, text, {"traceparent": header})
    assert on == off


def test_generate_continues_the_callers_trace(
    daemon: RunningDaemon,
    receiver: tuple[Receiver, int],  # noqa: F811
) -> None:
    header, trace_id, span_id = traceparent()
    body = {"x": [1.0, 2.0, 3.0, 4.0]}
    assert json.loads(_post(daemon, "/v2/models/double/generate", body, {"traceparent": header}))["y"] == [
        2.0,
        4.0,
        6.0,
        8.0,
    ]
    spans = wait_trace(receiver[0], trace_id, {"HTTP generate", *STAGES})
    check_request_trace(spans, "HTTP generate", span_id, trace_id)


def test_generate_stream_has_a_span_per_event(
    daemon: RunningDaemon,
    receiver: tuple[Receiver, int],  # noqa: F811
) -> None:
    header, trace_id, span_id = traceparent()
    events = _post(daemon, "/v2/models/double/generate_stream", {"x": [1.0] * 4}, {"traceparent": header})
    assert events.count(b"data: ") == 1
    spans = wait_trace(receiver[0], trace_id, {"HTTP generate_stream", *STAGES})
    check_request_trace(spans, "HTTP generate_stream", span_id, trace_id)


def test_openai_embeddings_continue_the_callers_trace(
    daemon: RunningDaemon,
    receiver: tuple[Receiver, int],  # noqa: F811
) -> None:
    header, trace_id, span_id = traceparent()
    _post(daemon, "/v1/embeddings", {"model": "embed", "input": "one text"}, {"traceparent": header})
    spans = wait_trace(receiver[0], trace_id, {"OpenAI embeddings", *STAGES})
    check_request_trace(spans, "OpenAI embeddings", span_id, trace_id)
    assert attributes(spans["OpenAI embeddings"][0])["model_name"] == "embed"


def test_an_openai_chat_has_a_span_per_response_of_its_decoupled_model(
    daemon: RunningDaemon,
    receiver: tuple[Receiver, int],  # noqa: F811
) -> None:
    header, trace_id, span_id = traceparent()
    body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "seed": 1}
    answer = json.loads(_post(daemon, "/v1/chat/completions", body, {"traceparent": header}))
    assert answer["usage"]["completion_tokens"] == 3
    # The root ends after its responses, so it may be exported in a later batch than theirs: wait for both.
    names = {"OpenAI chat", "parse", "checks", "queue", "execute"}
    spans = wait_named(
        receiver[0], trace_id, "3 responses", lambda s: len(s.get("response", [])) == 3 and names <= s.keys()
    )
    (root,) = spans["OpenAI chat"]
    assert root.parent_span_id.hex() == span_id
    assert attributes(root)["model_name"] == "chat"
    assert sorted(attributes(s)["index"] for s in spans["response"]) == [0, 1, 2]
    for name in ("parse", "checks", "queue", "execute", "response"):
        assert all(s.parent_span_id == root.span_id for s in spans[name]), name


def test_a_models_call_is_a_child_of_the_calling_execution(
    daemon: RunningDaemon,
    receiver: tuple[Receiver, int],  # noqa: F811
) -> None:
    header, trace_id, span_id = traceparent()
    result = daemon.client.infer("caller", [_x(np.ones(4, np.float32))], headers={"traceparent": header})
    assert result.as_numpy("y").tolist() == [3.0] * 4
    spans = wait_named(receiver[0], trace_id, "2 computes", lambda s: len(s.get("compute", [])) == 2)
    (root,) = spans["ModelInfer"]
    assert root.parent_span_id.hex() == span_id
    executions = {attributes(s)["model_name"]: s for s in spans["execute"]}
    (call,) = spans["call"]
    assert attributes(call)["model_name"] == "double"
    assert call.parent_span_id == executions["caller"].span_id  # under the execution that made it
    assert executions["double"].parent_span_id == call.span_id  # the called model's, under the call
    under_call = {s.name for group in spans.values() for s in group if s.parent_span_id == call.span_id}
    assert {"checks", "queue", "execute"} <= under_call
    assert call.start_time_unix_nano >= executions["caller"].start_time_unix_nano
    assert call.end_time_unix_nano <= executions["caller"].end_time_unix_nano


def _cache_counts(client: grpcclient.InferenceServerClient, model: str) -> tuple[int, int]:
    stats = client.get_inference_statistics(model, as_json=True)["model_stats"][0]
    return int(stats.get("execution_count", 0)), int(
        stats["inference_stats"].get("cache_hit", {}).get("count", 0)
    )


@pytest.mark.parametrize(
    ("model", "cached", "name", "add"),
    [("cached_pipeline", "cached_step", "X", 1.0), ("cached_caller", "cached_called", "x", 1.0)],
    ids=["ensemble step", "model call"],
)
def test_a_step_or_a_call_is_answered_from_the_response_cache(
    daemon: RunningDaemon, model: str, cached: str, name: str, add: float
) -> None:
    """The same request twice: the cached model runs once, the second time its answer comes from the
    cache (Triton's cache_hit), and the answers are the same."""
    values = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    before = _cache_counts(daemon.client, cached)
    out = "Y" if name == "X" else "y"
    results = [daemon.client.infer(model, [_x(values, name=name)]).as_numpy(out).tolist() for _ in range(2)]
    assert results == [(values * 3 + add).tolist()] * 2
    executions, hits = _cache_counts(daemon.client, cached)
    assert (executions - before[0], hits - before[1]) == (1, 1)
