"""Request traces through the real daemon, received by a real OTLP/gRPC trace receiver started here (the
TraceService of opentelemetry-proto): a gRPC and an HTTP request with a W3C traceparent each end in the
caller's trace with a span for every stage, the worker's span under the execution's; a batch's execution
links both its requests; a stream has a span per response and an ensemble one per step; sampling and the
trace-settings API (the stock tritonclient's, gRPC and HTTP) change what is exported."""

from __future__ import annotations

import concurrent.futures
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import yaml
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from tritonclient.utils import InferenceServerException

from mpsd.daemon.api.tracing import valid_traceparent
from tests import models
from tests.conftest import RunningDaemon, free_port, serving, wait_for
from tests.os_skips import shared_port_fronts

F4 = {"data_type": "TYPE_FP32", "dims": [4]}
STAGES = {"parse", "checks", "queue", "execute", "input copy", "compute", "output", "response"}


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):  # type: ignore[misc]
    """An OTLP trace receiver: keeps every span it is sent, with its service name."""

    def __init__(self) -> None:
        self.spans: list[Any] = []
        self.services: set[str] = set()
        self.lock = threading.Lock()

    def Export(self, request: Any, context: Any) -> Any:
        with self.lock:
            for resource_spans in request.resource_spans:
                for attribute in resource_spans.resource.attributes:
                    if attribute.key == "service.name":
                        self.services.add(attribute.value.string_value)
                for scope_spans in resource_spans.scope_spans:
                    self.spans.extend(scope_spans.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str) -> list[Any]:
        with self.lock:
            return [s for s in self.spans if s.trace_id.hex() == trace_id]

    def with_attribute(self, key: str, value: str) -> list[Any]:
        with self.lock:
            return [s for s in self.spans if attributes(s).get(key) == value]


def attributes(span: Any) -> dict[str, Any]:
    out = {}
    for a in span.attributes:
        v = a.value
        out[a.key] = v.string_value if v.HasField("string_value") else v.int_value
    return out


def traceparent() -> tuple[str, str, str]:
    """A caller's trace: (traceparent, trace id, span id)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def by_name(spans: list[Any]) -> dict[str, list[Any]]:
    named: dict[str, list[Any]] = {}
    for span in spans:
        named.setdefault(span.name, []).append(span)
    return named


@pytest.fixture(scope="module")
def receiver() -> Iterator[tuple[Receiver, int]]:
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=4))
    found = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(found, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    yield found, port
    server.stop(0)


@pytest.fixture(scope="module")
def daemon(
    tmp_path_factory: pytest.TempPathFactory, receiver: tuple[Receiver, int]
) -> Iterator[RunningDaemon]:
    tmp = tmp_path_factory.mktemp("tracing")
    repo = tmp / "repo"
    models.add_sub(repo, dims=4)
    models.add_sub(repo, name="lazy", dims=4, residency={"load": "on_demand"})
    models.add_sub(  # two requests a batch: the first waits for the second
        repo,
        name="paired",
        dims=4,
        max_batch_size=2,
        dynamic_batching={"preferred_batch_size": [2], "max_queue_delay_microseconds": 10_000_000},
    )
    _python(repo, "double", "return {'y': inputs['x'] * 2}")
    _python(repo, "plus_one", "return {'y': inputs['x'] + 1}")
    models.write_config(
        repo / "pipeline",
        {
            "backend": "ensemble",
            "max_batch_size": 0,
            "input": [{"name": "X", **F4}],
            "output": [{"name": "Y", **F4}],
            "ensemble_scheduling": {
                "step": [
                    {"model_name": "double", "input_map": {"x": "X"}, "output_map": {"y": "d"}},
                    {"model_name": "plus_one", "input_map": {"x": "d"}, "output_map": {"y": "Y"}},
                ]
            },
        },
    )
    (repo / "pipeline" / "1").mkdir()
    models.python_model(
        repo,
        "counter",
        "for i in range(int(inputs['n'][0])):\n    yield {'i': torch.tensor([i], dtype=torch.int64)}",
        config={
            "backend": "python",
            "max_batch_size": 0,
            "input": [{"name": "n", "data_type": "TYPE_INT64", "dims": [1]}],
            "output": [{"name": "i", "data_type": "TYPE_INT64", "dims": [1]}],
            "model_transaction_policy": {"decoupled": True},
        },
    )
    config = tmp / "mpsd.yaml"
    trace = {
        "level": ["TIMESTAMPS"],
        "rate": 0,  # only requests that carry a traceparent, unless a test sets a rate
        "protocol": "grpc",
        "endpoint": f"127.0.0.1:{receiver[1]}",
        "bsp_schedule_delay_ms": 50,
        "resource": {"service.name": "mpsd-under-test"},
    }
    config.write_text(yaml.safe_dump({"trace": trace, "metrics_address": "off"}))
    with serving(repo, tmp / "daemon.log", config=config) as running:
        yield running


def _python(repo: Path, name: str, body: str) -> None:
    models.python_model(
        repo,
        name,
        body,
        config={
            "backend": "python",
            "max_batch_size": 0,
            "input": [{"name": "x", **F4}],
            "output": [{"name": "y", **F4}],
        },
    )


@pytest.fixture
def clients(daemon: RunningDaemon) -> Iterator[tuple[grpcclient.InferenceServerClient, Any]]:
    """Both clients; the global and the models' trace settings are cleared after the test."""
    http = httpclient.InferenceServerClient(daemon.http_address)
    yield daemon.client, http
    cleared = {"trace_level": None, "trace_rate": None, "trace_count": None, "log_frequency": None}
    for model in ("add_sub", ""):
        daemon.client.update_trace_settings(model_name=model, settings=cleared)
    http.close()


def add_sub_inputs(grpc_side: bool = True) -> list[Any]:
    module: Any = grpcclient if grpc_side else httpclient
    inputs = [module.InferInput(name, [1, 4], "FP32") for name in ("INPUT0", "INPUT1")]
    for tensor in inputs:
        tensor.set_data_from_numpy(np.ones((1, 4), dtype=np.float32))
    return inputs


def wait_named(found: Receiver, trace_id: str, what: str, ready: Any) -> dict[str, list[Any]]:
    """The trace's spans by name, once `ready(them)` (the receiver gets them as the exporter sends them)."""

    def check() -> dict[str, list[Any]] | None:
        named = by_name(found.trace(trace_id))
        return named if ready(named) else None

    return wait_for(check, 30, f"{what} of trace {trace_id}")  # type: ignore[no-any-return]


def wait_trace(found: Receiver, trace_id: str, names: set[str]) -> dict[str, list[Any]]:
    return wait_named(found, trace_id, f"spans {sorted(names)}", lambda named: names <= named.keys())


def check_request_trace(spans: dict[str, list[Any]], root_name: str, caller_span: str, trace_id: str) -> None:
    """Every stage under the request's span, the execution's stages under the execution, the worker's span
    (sent by the worker, exported by the daemon) under the execution too."""
    (root,) = spans[root_name]
    assert root.parent_span_id.hex() == caller_span  # the caller's trace continues
    assert root.kind == root.SPAN_KIND_SERVER
    for name in ("parse", "checks", "queue", "execute", "response"):
        (span,) = spans[name]
        assert span.parent_span_id == root.span_id, name
    (execute,) = spans["execute"]
    for name in ("input copy", "compute", "output"):
        (span,) = spans[name]
        assert span.parent_span_id == execute.span_id, name
    (compute,) = spans["compute"]
    assert attributes(compute)["process"] == "worker"
    assert attributes(compute)["compute_infer_ns"] > 0
    assert execute.start_time_unix_nano <= compute.start_time_unix_nano <= compute.end_time_unix_nano
    assert compute.end_time_unix_nano <= execute.end_time_unix_nano
    assert root.start_time_unix_nano <= execute.start_time_unix_nano
    assert execute.end_time_unix_nano <= root.end_time_unix_nano
    assert {s.trace_id.hex() for group in spans.values() for s in group} == {trace_id}


def test_a_grpc_request_with_a_traceparent_continues_the_callers_trace_through_daemon_and_worker(
    daemon: RunningDaemon, receiver: tuple[Receiver, int], clients: Any
) -> None:
    found = receiver[0]
    header, trace_id, span_id = traceparent()
    # The first request of a model that loads on demand: its wait for the load is a span too.
    daemon.client.infer("lazy", add_sub_inputs(), headers={"traceparent": header})
    spans = wait_trace(found, trace_id, {"ModelInfer", "load", *STAGES})
    check_request_trace(spans, "ModelInfer", span_id, trace_id)
    (load,) = spans["load"]
    assert load.parent_span_id == spans["ModelInfer"][0].span_id
    assert attributes(spans["ModelInfer"][0])["model_name"] == "lazy"
    assert "mpsd-under-test" in found.services


def test_an_http_request_with_a_traceparent_continues_the_callers_trace(
    daemon: RunningDaemon, receiver: tuple[Receiver, int], clients: Any
) -> None:
    _, http = clients
    header, trace_id, span_id = traceparent()
    http.infer("add_sub", add_sub_inputs(grpc_side=False), headers={"traceparent": header})
    spans = wait_trace(receiver[0], trace_id, {"HTTP ModelInfer", *STAGES})
    check_request_trace(spans, "HTTP ModelInfer", span_id, trace_id)
    assert "load" not in spans  # loaded already: no wait


def test_one_execution_of_a_batch_links_both_requests(
    daemon: RunningDaemon, receiver: tuple[Receiver, int], clients: Any
) -> None:
    found = receiver[0]
    callers = [traceparent() for _ in range(2)]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(
            pool.map(
                lambda c: daemon.client.infer("paired", add_sub_inputs(), headers={"traceparent": c[0]}),
                callers,
            )
        )
    roots = []
    for _, trace_id, _ in callers:
        spans = wait_trace(found, trace_id, {"ModelInfer", "queue", "response"})
        roots.append(spans["ModelInfer"][0])
    executions = [
        s for s in found.with_attribute("model_name", "paired") if s.name == "execute" and len(s.links) == 2
    ]
    assert len(executions) == 1, "one execution for the two requests"
    (execute,) = executions
    assert {(link.trace_id, link.span_id) for link in execute.links} == {
        (r.trace_id, r.span_id) for r in roots
    }
    assert attributes(execute)["batch_size"] == 2
    assert execute.parent_span_id in {r.span_id for r in roots}  # under the first request's span
    compute = wait_for(
        lambda: [s for s in found.trace(execute.trace_id.hex()) if s.name == "compute"],
        30,
        "the worker's span of the batch",
    )
    assert compute[0].parent_span_id == execute.span_id


def test_a_stream_has_a_span_per_response(
    daemon: RunningDaemon, receiver: tuple[Receiver, int], clients: Any
) -> None:
    header, trace_id, span_id = traceparent()
    received: list[Any] = []
    done = threading.Event()

    def callback(result: Any, error: Any) -> None:
        received.append(error or result)
        if len(received) == 3:
            done.set()

    client = grpcclient.InferenceServerClient(daemon.address)
    client.start_stream(callback, headers={"traceparent": header})
    n = grpcclient.InferInput("n", [1], "INT64")
    n.set_data_from_numpy(np.array([3], dtype=np.int64))
    client.async_stream_infer("counter", [n])
    assert done.wait(30)
    client.stop_stream()
    spans = wait_trace(receiver[0], trace_id, {"ModelStreamInfer", "queue", "execute", "compute"})
    spans = wait_named(receiver[0], trace_id, "3 responses", lambda s: len(s.get("response", [])) == 3)
    (root,) = spans["ModelStreamInfer"]
    assert root.parent_span_id.hex() == span_id
    assert sorted(attributes(s)["index"] for s in spans["response"]) == [0, 1, 2]
    assert all(s.parent_span_id == root.span_id for s in spans["response"])
    assert spans["compute"][0].parent_span_id == spans["execute"][0].span_id


def test_an_ensemble_has_a_span_per_step_with_its_models_execution_under_it(
    daemon: RunningDaemon, receiver: tuple[Receiver, int], clients: Any
) -> None:
    header, trace_id, _ = traceparent()
    x = grpcclient.InferInput("X", [4], "FP32")
    x.set_data_from_numpy(np.arange(4, dtype=np.float32))
    result = daemon.client.infer("pipeline", [x], headers={"traceparent": header})
    assert result.as_numpy("Y").tolist() == [1.0, 3.0, 5.0, 7.0]
    spans = wait_named(receiver[0], trace_id, "2 computes", lambda s: len(s.get("compute", [])) == 2)
    (root,) = spans["ModelInfer"]
    steps = {attributes(s)["model_name"]: s for s in spans["step"]}
    assert set(steps) == {"double", "plus_one"}
    assert all(s.parent_span_id == root.span_id for s in steps.values())
    executions = {attributes(s)["model_name"]: s for s in spans["execute"]}
    for model, step in steps.items():
        assert executions[model].parent_span_id == step.span_id
    assert {c.parent_span_id for c in spans["compute"]} == {e.span_id for e in executions.values()}


def traced_ids(found: Receiver, prefix: str) -> set[str]:
    with found.lock:
        return {
            attributes(s)["request_id"]
            for s in found.spans
            if s.name in ("ModelInfer", "HTTP ModelInfer")
            and str(attributes(s).get("request_id", "")).startswith(prefix)
        }


def marker(daemon: RunningDaemon, found: Receiver, model: str = "add_sub") -> None:
    """A request with a traceparent, sent after the ones a test looks at, and waited for: the spans of the
    earlier requests, had they been traced, ended before its own and are exported by now."""
    header, trace_id, _ = traceparent()
    daemon.client.infer(model, add_sub_inputs(), headers={"traceparent": header})
    wait_trace(found, trace_id, {"ModelInfer", "response"})


def test_traceparent_versions_as_w3c_trace_context_says() -> None:
    _, trace_id, span_id = traceparent()
    four = f"{trace_id}-{span_id}-01"
    assert valid_traceparent(f" 00-{four} ") == f"00-{four}"
    assert valid_traceparent(f"ff-{four}") is None  # version ff is invalid
    assert valid_traceparent(f"00-{four}-more") is None  # version 00 has exactly four fields
    assert valid_traceparent(f"01-{four}-what-comes-later") == f"01-{four}"  # a later one: its first four
    assert valid_traceparent(f"01-{four}") == f"01-{four}"
    assert valid_traceparent(f"01-{four}x") is None  # more must follow a '-'
    assert valid_traceparent(f"00-{'0' * 32}-{span_id}-01") is None
    assert valid_traceparent(f"00-{trace_id.upper()}-{span_id}-01") is None


def test_a_version_ff_traceparent_is_ignored_and_a_later_version_continued(
    daemon: RunningDaemon, receiver: tuple[Receiver, int], clients: Any
) -> None:
    """At rate 0 a request with an invalid traceparent (version ff) is not traced, as one without; one of a
    later version with more fields continues the caller's trace by its first four."""
    found = receiver[0]
    _, ff_trace, ff_span = traceparent()
    client = clients[0]
    client.infer(
        "add_sub", add_sub_inputs(), request_id="ff-1", headers={"traceparent": f"ff-{ff_trace}-{ff_span}-01"}
    )
    _, later_trace, later_span = traceparent()
    client.infer(
        "add_sub", add_sub_inputs(), headers={"traceparent": f"01-{later_trace}-{later_span}-01-x-y"}
    )
    spans = wait_trace(found, later_trace, {"ModelInfer", "response"})
    assert spans["ModelInfer"][0].parent_span_id.hex() == later_span
    marker(daemon, found)
    assert traced_ids(found, "ff-") == set()
    assert not found.trace(ff_trace)


def test_sampling_one_request_in_rate_while_the_count_lasts_and_a_traceparent_always(
    daemon: RunningDaemon, receiver: tuple[Receiver, int], clients: Any
) -> None:
    found = receiver[0]
    client, http = clients
    for i in range(3):  # rate 0 (the config's): requests without a traceparent are not traced
        client.infer("add_sub", add_sub_inputs(), request_id=f"none-{i}")
    current = http.update_trace_settings(settings={"trace_rate": "2", "trace_count": "1"})
    assert (current["trace_rate"], current["trace_count"]) == ("2", "1")
    for i in range(1, 5):
        client.infer("add_sub", add_sub_inputs(), request_id=f"rate-{i}")
    marker(daemon, found)
    assert traced_ids(found, "none-") == set()
    assert traced_ids(found, "rate-") == {"rate-2"}  # the 2nd; the 4th too, but the count had run out
    assert http.get_trace_settings()["trace_count"] == "0"


def test_trace_level_off_for_one_model_and_cleared_back_to_the_global_setting(
    daemon: RunningDaemon, receiver: tuple[Receiver, int], clients: Any
) -> None:
    found = receiver[0]
    client, http = clients
    client.update_trace_settings(model_name="add_sub", settings={"trace_level": ["OFF"]})
    header, trace_id, _ = traceparent()
    client.infer("add_sub", add_sub_inputs(), headers={"traceparent": header})
    http.infer("add_sub", add_sub_inputs(grpc_side=False), headers={"traceparent": header})
    marker(daemon, found, "lazy")  # another model: still traced
    assert found.trace(trace_id) == []
    http.update_trace_settings(model_name="add_sub", settings={"trace_level": None})
    assert http.get_trace_settings(model_name="add_sub")["trace_level"] == ["TIMESTAMPS"]
    client.infer("add_sub", add_sub_inputs(), headers={"traceparent": header})
    wait_trace(found, trace_id, {"ModelInfer", *STAGES})


def settings_of(client: grpcclient.InferenceServerClient, model: str = "") -> dict[str, list[str]]:
    reply = client.get_trace_settings(model_name=model, as_json=True)
    return {k: v.get("value", []) for k, v in reply["settings"].items()}


def test_the_settings_api_follows_tritons_fallbacks_and_messages(
    daemon: RunningDaemon, receiver: tuple[Receiver, int], clients: Any
) -> None:
    client, http = clients
    port = receiver[1]
    assert settings_of(client) == {
        "trace_level": ["TIMESTAMPS"],
        "trace_rate": ["0"],
        "trace_count": ["-1"],
        "trace_mode": ["opentelemetry"],
        "url": [f"127.0.0.1:{port}"],
        "bsp_max_queue_size": ["2048"],
        "bsp_schedule_delay": ["50"],
        "bsp_max_export_batch_size": ["512"],
    }
    # A model's own field stays its own; the others follow the global setting as it changes.
    client.update_trace_settings(model_name="add_sub", settings={"trace_rate": "5"})
    client.update_trace_settings(settings={"trace_count": "7", "trace_rate": "3"})
    model = settings_of(client, "add_sub")
    assert (model["trace_rate"], model["trace_count"], model["trace_level"]) == (["5"], ["7"], ["TIMESTAMPS"])
    assert http.get_trace_settings(model_name="add_sub")["trace_rate"] == "5"
    assert settings_of(client)["trace_rate"] == ["3"]
    # Clearing returns a field to its fallback: the model's to the global one, the global to the config.
    client.update_trace_settings(model_name="add_sub", settings={"trace_rate": None})
    assert settings_of(client, "add_sub")["trace_rate"] == ["3"]
    client.update_trace_settings(settings={"trace_rate": None, "trace_count": None})
    assert (settings_of(client)["trace_rate"], settings_of(client, "add_sub")["trace_count"]) == (
        ["0"],
        ["-1"],
    )

    grpc_errors = [
        ({"trace_file": "/tmp/x"}, "trace file location can not be updated through network protocol", ""),
        ({"trace_count": "-2"}, "Unable to parse 'trace_count'. Expecting value >= -1, got: -2", ""),
        ({"trace_rate": "often"}, "Unable to parse 'trace_rate', got: often", ""),
        ({"trace_rate": ["1", "2"]}, "expect only 1 value for 'trace_rate'", ""),
        ({"trace_level": ["OFF", "TIMESTAMPS"]}, "Expect only one trace level 'OFF' is specified", ""),
        ({"trace_rate": "0"}, "Attempting to set invalid trace setting :sample rate must be non-zero", ""),
        ({"trace_rate": "1"}, "Request for unknown model : nope", "nope"),
    ]
    for settings, message, model_name in grpc_errors:
        with pytest.raises(InferenceServerException) as failed:
            client.update_trace_settings(model_name=model_name, settings=settings)
        assert failed.value.message() == message
        expected = "StatusCode.UNIMPLEMENTED" if "trace_file" in settings else "StatusCode.INVALID_ARGUMENT"
        assert failed.value.status() == expected
    with pytest.raises(InferenceServerException) as failed:
        http.update_trace_settings(settings={"trace_count": "-2"})
    assert failed.value.message() == "Unable to parse 'trace_count'. Expecting value >= -1, got:-2"
    assert failed.value.status() == "400"
    with pytest.raises(InferenceServerException) as failed:
        http.update_trace_settings(settings={"trace_file": "/tmp/x"})
    assert failed.value.status() == "501"
    assert settings_of(client) == settings_of(client, "add_sub")  # nothing of the refused changes applied


@shared_port_fronts()
def test_a_call_through_a_front_process_continues_the_callers_trace(
    tmp_path: Path, receiver: tuple[Receiver, int]
) -> None:
    """With front processes gRPC is served by them: the traceparent crosses the front link."""
    found, port = receiver
    repo = tmp_path / "repo"
    models.add_sub(repo, dims=4)
    config = tmp_path / "mpsd.yaml"
    trace = {"level": "TIMESTAMPS", "rate": 0, "protocol": "grpc", "endpoint": f"127.0.0.1:{port}"}
    config.write_text(
        yaml.safe_dump({"trace": {**trace, "bsp_schedule_delay_ms": 50}, "metrics_address": "off"})
    )
    with serving(
        repo, tmp_path / "daemon.log", config=config, extra_args=["--front-processes", "1"]
    ) as daemon:
        header, trace_id, span_id = traceparent()
        for _ in range(2):  # the second with a known header
            daemon.client.infer("add_sub", add_sub_inputs(), headers={"traceparent": header})
        spans = wait_named(found, trace_id, "2 requests", lambda s: len(s.get("compute", [])) == 2)
    assert {root.parent_span_id.hex() for root in spans["ModelInfer"]} == {span_id}
    for compute in spans["compute"]:
        assert compute.parent_span_id in {e.span_id for e in spans["execute"]}


def small_daemon(tmp_path: Path, trace: dict[str, Any]) -> RunningDaemon:
    repo = tmp_path / "repo"
    models.add_sub(repo, dims=4)
    config = tmp_path / "mpsd.yaml"
    config.write_text(
        yaml.safe_dump({"trace": {"level": "TIMESTAMPS", "rate": 1, **trace}, "metrics_address": "off"})
    )
    daemon = RunningDaemon(repo, tmp_path / "daemon.log", config=config)
    daemon.wait_ready()
    return daemon


def test_the_spans_still_held_at_the_stop_are_sent_and_a_silent_collector_holds_the_stop_briefly(
    tmp_path: Path, receiver: tuple[Receiver, int]
) -> None:
    found, port = receiver
    # An export every minute: the spans of this request leave only with the stop.
    daemon = small_daemon(
        tmp_path / "a", {"protocol": "grpc", "endpoint": f"127.0.0.1:{port}", "bsp_schedule_delay_ms": 60_000}
    )
    try:
        daemon.client.infer("add_sub", add_sub_inputs(), request_id="held-at-stop")
        started = time.monotonic()
        assert daemon.stop() == 0
        usual = time.monotonic() - started  # a stop whose collector answers
    finally:
        daemon.kill_group()
    assert traced_ids(found, "held-at-stop") == {"held-at-stop"}
    # A collector that takes the connection and never answers (a listening socket nobody accepts on).
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(0)
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}/v1/traces"
        daemon = small_daemon(
            tmp_path / "b", {"protocol": "http", "endpoint": endpoint, "bsp_schedule_delay_ms": 60_000}
        )
        try:
            daemon.client.infer("add_sub", add_sub_inputs())
            started = time.monotonic()
            assert daemon.stop() == 0
            # The flush's bound (3 s) beyond a usual stop, not an export's own limit or its retries.
            assert time.monotonic() - started < usual + 6
        finally:
            daemon.kill_group()


def test_spans_go_over_otlp_http_too(tmp_path: Path) -> None:
    """protocol http (the default): OTLP's protobuf over HTTP POST, received by a plain HTTP server here."""
    import http.server

    received: list[Any] = []
    paths: set[str] = set()

    class OtlpHttp(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            paths.add(self.path)
            body = self.rfile.read(int(self.headers["Content-Length"]))
            request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
            received.extend(s for r in request.resource_spans for ss in r.scope_spans for s in ss.spans)
            reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), OtlpHttp)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}/v1/traces"
    daemon = small_daemon(tmp_path, {"endpoint": endpoint, "bsp_schedule_delay_ms": 50})
    try:
        header, trace_id, span_id = traceparent()
        daemon.client.infer("add_sub", add_sub_inputs(), headers={"traceparent": header})
        spans = wait_for(
            lambda: (lambda s: s if {"ModelInfer", "compute"} <= {x.name for x in s} else None)(
                [s for s in list(received) if s.trace_id.hex() == trace_id]
            ),
            30,
            "the spans over OTLP/HTTP",
        )
    finally:
        daemon.stop()
        daemon.kill_group()
        server.shutdown()
        server.server_close()
    (root,) = [s for s in spans if s.name == "ModelInfer"]
    assert root.parent_span_id.hex() == span_id
    assert paths == {"/v1/traces"}  # the configured endpoint's


def test_nothing_of_opentelemetry_is_imported_until_a_span_is_made() -> None:
    """The daemon's and the worker's modules, the settings and sampling import no OpenTelemetry: a daemon
    that does not trace never pays for it, at its start or per request."""
    code = """
import sys
import mpsd.daemon.main, mpsd.worker.main, mpsd.worker.serve, mpsd.worker.tracing
from mpsd.config.daemon_config import TraceConfig
from mpsd.daemon.api.tracing import Tracing, incoming
tracing = Tracing(TraceConfig(level=["TIMESTAMPS"], rate=0))
tracing.update("", {"trace_rate": "5", "trace_count": "3"})
assert not tracing.begin("m", "", "", incoming(None, "ModelInfer")).traced  # sampled out
loaded = sorted(m for m in sys.modules if m.startswith("opentelemetry"))
assert not loaded, loaded
"""
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parent.parent)


# On a real CUDA GPU (skipped without one): the execution's span and the worker's carry the device's own
# time of the model call, read from the CUDA events recorded around it, as an attribute.
NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def gpu_daemon(
    tmp_path_factory: pytest.TempPathFactory,
    receiver: tuple[Receiver, int],
) -> Iterator[RunningDaemon]:
    tmp = tmp_path_factory.mktemp("tracing_gpu")
    repo = tmp / "repo"
    models.add_sub(repo, dims=4, instance_group=[{"kind": "KIND_GPU", "count": 1}])
    config = tmp / "mpsd.yaml"
    trace = {
        "level": ["TIMESTAMPS"],
        "rate": 0,
        "protocol": "grpc",
        "endpoint": f"127.0.0.1:{receiver[1]}",
        "bsp_schedule_delay_ms": 50,
    }
    config.write_text(yaml.safe_dump({"trace": trace, "metrics_address": "off"}))
    with serving(repo, tmp / "daemon.log", config=config) as running:
        yield running


@NEEDS_CUDA
def test_the_execution_and_the_workers_span_carry_the_device_time(
    gpu_daemon: RunningDaemon, receiver: tuple[Receiver, int]
) -> None:
    header, trace_id, span_id = traceparent()
    gpu_daemon.client.infer("add_sub", add_sub_inputs(), headers={"traceparent": header})
    spans = wait_trace(receiver[0], trace_id, {"ModelInfer", *STAGES})
    check_request_trace(spans, "ModelInfer", span_id, trace_id)
    (execute,), (compute,) = spans["execute"], spans["compute"]
    device_ns = attributes(execute)["device_compute_ns"]
    assert 0 < device_ns <= compute.end_time_unix_nano - compute.start_time_unix_nano
    assert attributes(compute)["device_compute_ns"] == device_ns
