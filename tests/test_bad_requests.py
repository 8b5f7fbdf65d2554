"""Malformed inference requests: each gets its own status code and a message that names the problem, and
none of them disturbs the daemon or its workers."""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests import models
from tests.conftest import RunningDaemon, serving

INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    repo = tmp_path_factory.mktemp("repo")
    models.add_sub(repo)  # INPUT0/INPUT1 FP32 [16], max_batch_size 8
    with serving(repo, tmp_path_factory.mktemp("log") / "daemon.log") as d:
        yield d


@pytest.fixture(scope="module")
def stub(daemon: RunningDaemon) -> Iterator[service_pb2_grpc.GRPCInferenceServiceStub]:
    channel = grpc.insecure_channel(daemon.address)
    try:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)
    finally:
        channel.close()


# ---- request builders ------------------------------------------------------------------------------


def _input(name: str, value: np.ndarray, datatype: str | None = None) -> grpcclient.InferInput:
    inp = grpcclient.InferInput(name, list(value.shape), datatype or "FP32")
    inp.set_data_from_numpy(value)
    return inp


def _pair(batch: int = 1) -> list[grpcclient.InferInput]:
    a = np.ones((batch, 16), np.float32)
    return [_input("INPUT0", a), _input("INPUT1", a)]


def _raw_request(
    shape0: list[int], data0: bytes | None = None, fp32_contents0: list[float] | None = None
) -> service_pb2.ModelInferRequest:
    """INPUT0 as given (raw bytes or typed contents), INPUT1 a valid [1, 16] FP32 tensor."""
    req = service_pb2.ModelInferRequest(model_name="add_sub")
    t0 = req.inputs.add(name="INPUT0", datatype="FP32", shape=shape0)
    t1 = req.inputs.add(name="INPUT1", datatype="FP32", shape=[1, 16])
    if fp32_contents0 is not None:
        t0.contents.fp32_contents.extend(fp32_contents0)
        t1.contents.fp32_contents.extend([1.0] * 16)
    else:
        req.raw_input_contents.append(data0 or b"")
        req.raw_input_contents.append(np.ones(16, np.float32).tobytes())
    return req


Sender = Callable[[RunningDaemon, service_pb2_grpc.GRPCInferenceServiceStub], None]


@dataclass(frozen=True)
class Case:
    id: str
    send: Sender
    code: grpc.StatusCode
    words: tuple[str, ...]  # each must appear in the message


def _client(model: str, inputs: Callable[[], list[grpcclient.InferInput]], **kwargs: object) -> Sender:
    def send(daemon: RunningDaemon, stub: object) -> None:
        daemon.client.infer(model, inputs(), **kwargs)  # type: ignore[arg-type]

    return send


def _raw(build: Callable[[], service_pb2.ModelInferRequest]) -> Sender:
    def send(daemon: RunningDaemon, stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
        stub.ModelInfer(build(), timeout=30)

    return send


CASES = [
    Case(
        "unknown_model",
        _client("no_such_model", _pair),
        NOT_FOUND,
        ("Request for unknown model: 'no_such_model' is not found",),
    ),
    Case(
        "unknown_version",
        _client("add_sub", _pair, model_version="7"),
        NOT_FOUND,
        ("Request for unknown model: 'add_sub' version 7 is not found",),
    ),
    Case(
        "non_numeric_version",
        _client("add_sub", _pair, model_version="v1"),
        INVALID,
        ("failed to get model version from specified version string 'v1'",),
    ),
    Case(
        "missing_input",
        _client("add_sub", lambda: _pair()[:1]),
        INVALID,
        ("missing input", "INPUT1", "add_sub"),
    ),
    Case(
        "unknown_input",
        _client("add_sub", lambda: [*_pair(), _input("INPUT2", np.ones((1, 16), np.float32))]),
        INVALID,
        ("unknown input", "INPUT2", "add_sub", "INPUT0, INPUT1"),
    ),
    Case(
        "duplicate_input",
        _client("add_sub", lambda: [*_pair(), _input("INPUT0", np.ones((1, 16), np.float32))]),
        INVALID,
        ("duplicate input", "INPUT0"),
    ),
    Case(
        "wrong_datatype",
        _client("add_sub", lambda: [_input("INPUT0", np.ones((1, 16), np.int32), "INT32"), _pair()[1]]),
        INVALID,
        ("INPUT0", "expected datatype FP32", "INT32"),
    ),
    Case(
        "shape_not_matching_dims",
        _client("add_sub", lambda: [_input("INPUT0", np.ones((1, 8), np.float32)), _pair()[1]]),
        INVALID,
        ("INPUT0", "shape [1, 8]", "dims [16]"),
    ),
    Case(
        "raw_length_not_matching",
        _raw(lambda: _raw_request([1, 16], np.ones(15, np.float32).tobytes())),
        INVALID,
        ("INPUT0", "60 bytes", "expected 64", "[1, 16]", "FP32"),
    ),
    Case(
        "batch_too_large",
        _client("add_sub", lambda: _pair(batch=9)),
        INVALID,
        ("INPUT0", "batch size 9", "max_batch_size 8"),
    ),
    Case(
        "bytes_datatype",
        _client(
            "add_sub",
            lambda: [_input("INPUT0", np.array([[b"x"] * 16], dtype=np.object_), "BYTES"), _pair()[1]],
        ),
        INVALID,
        ("INPUT0", "expected datatype FP32", "'BYTES'"),
    ),
    Case(
        "unknown_output",
        _client("add_sub", _pair, outputs=[grpcclient.InferRequestedOutput("OUTPUT9")]),
        INVALID,
        ("unknown output", "OUTPUT9", "add_sub", "OUTPUT0, OUTPUT1"),
    ),
    Case(
        "typed_contents_wrong_count",
        _raw(lambda: _raw_request([1, 16], fp32_contents0=[1.0] * 15)),
        INVALID,
        ("INPUT0", "15 elements", "expected 16"),
    ),
    Case(
        "negative_dims",
        _raw(lambda: _raw_request([1, -16], b"")),
        INVALID,
        ("INPUT0", "[1, -16]", "negative"),
    ),
    Case(
        "batch_sizes_differ",
        _client("add_sub", lambda: [_pair(batch=2)[0], _pair(batch=3)[1]]),
        INVALID,
        ("INPUT1", "batch size 3", "batch size 2"),
    ),
    Case(
        "typed_contents_in_wrong_field",
        _raw(lambda: _with_int_contents(_raw_request([1, 16], fp32_contents0=[]))),
        INVALID,
        ("INPUT0", "fp32_contents", "int_contents"),
    ),
]


def _with_int_contents(req: service_pb2.ModelInferRequest) -> service_pb2.ModelInferRequest:
    req.inputs[0].contents.int_contents.extend([1] * 16)
    return req


def _error_of(
    case: Case, daemon: RunningDaemon, stub: service_pb2_grpc.GRPCInferenceServiceStub
) -> tuple[str, str]:
    """(status code name, message) of the failed call; fails the test when the call succeeds."""
    try:
        case.send(daemon, stub)
    except InferenceServerException as exc:
        return str(exc.status()), str(exc.message())
    except grpc.RpcError as exc:
        return str(exc.code()), str(exc.details())
    pytest.fail(f"{case.id}: the request was accepted")


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_request_gets_code_and_message(
    case: Case, daemon: RunningDaemon, stub: service_pb2_grpc.GRPCInferenceServiceStub
) -> None:
    code, message = _error_of(case, daemon, stub)
    assert code == str(case.code), message
    for word in case.words:
        assert word in message, f"{word!r} not in {message!r}"


def test_version_of_non_ascii_digits_is_no_version(daemon: RunningDaemon) -> None:
    with pytest.raises(InferenceServerException) as exc:
        daemon.client.infer("add_sub", _pair(), model_version="\u00b2")
    assert exc.value.status() == str(INVALID), exc.value.message()
    assert "version string '\u00b2'" in exc.value.message()


def test_bad_requests_leave_daemon_and_workers_untouched(
    daemon: RunningDaemon, stub: service_pb2_grpc.GRPCInferenceServiceStub
) -> None:
    pids = sorted(daemon.worker_pids())
    assert pids, "the model has no worker process"
    for case in CASES:
        code, _ = _error_of(case, daemon, stub)
        assert code == str(case.code)
    assert daemon.proc.poll() is None
    assert sorted(daemon.worker_pids()) == pids
    assert daemon.client.is_server_ready()
    a = np.arange(32, dtype=np.float32).reshape(2, 16)
    b = np.full((2, 16), 2.0, np.float32)
    result = daemon.client.infer("add_sub", [_input("INPUT0", a), _input("INPUT1", b)])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)


def test_bad_requests_in_a_stream_are_answered_in_band(daemon: RunningDaemon) -> None:
    results: queue.Queue[tuple[object, object]] = queue.Queue()
    client = grpcclient.InferenceServerClient(daemon.address)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    a = np.ones((1, 16), np.float32)
    try:
        client.async_stream_infer("add_sub", _pair(), request_id="ok1")
        client.async_stream_infer("add_sub", _pair(batch=9), request_id="too_big")
        client.async_stream_infer("no_such_model", _pair(), request_id="unknown")
        client.async_stream_infer(
            "add_sub", _pair(), request_id="bad_output", outputs=[grpcclient.InferRequestedOutput("OUTPUT9")]
        )
        client.async_stream_infer("add_sub", [_input("INPUT0", a * 3), _input("INPUT1", a)], request_id="ok2")
        got = [results.get(timeout=30) for _ in range(5)]
    finally:
        client.stop_stream()
        client.close()
    (r1, e1), (r2, e2), (r3, e3), (r4, e4), (r5, e5) = got
    assert e1 is None and r1.get_response().id == "ok1"  # type: ignore[attr-defined]
    for result, error, words in (
        (r2, e2, ("INPUT0", "batch size 9", "max_batch_size 8")),
        (r3, e3, ("Request for unknown model: 'no_such_model' is not found",)),
        (r4, e4, ("unknown output", "OUTPUT9")),
    ):
        assert result is None
        assert isinstance(error, InferenceServerException)
        for word in words:
            assert word in error.message(), f"{word!r} not in {error.message()!r}"
    assert e5 is None and r5.get_response().id == "ok2"  # type: ignore[attr-defined]
    np.testing.assert_array_equal(r5.as_numpy("OUTPUT0"), a * 4)  # type: ignore[attr-defined]


def test_stream_error_message_field_and_stream_continues(
    daemon: RunningDaemon, stub: service_pb2_grpc.GRPCInferenceServiceStub
) -> None:
    """On the wire: a bad request in a stream gets a response with error_message set; the stream goes on."""
    good = _raw_request([1, 16], np.ones(16, np.float32).tobytes())
    good.id = "good"
    bad = _raw_request([1, 16], np.ones(15, np.float32).tobytes())
    bad.id = "bad"
    later = _raw_request([1, 16], np.full(16, 2.0, np.float32).tobytes())
    later.id = "later"
    responses = list(stub.ModelStreamInfer(iter([good, bad, later]), timeout=30))
    assert [r.infer_response.id for r in responses] == ["good", "bad", "later"]
    assert responses[0].error_message == ""
    assert "INPUT0" in responses[1].error_message and "60 bytes" in responses[1].error_message
    assert responses[1].infer_response.model_name == "add_sub"
    assert responses[2].error_message == ""
    out = np.frombuffer(responses[2].infer_response.raw_output_contents[0], np.float32)
    np.testing.assert_array_equal(out, np.full(16, 3.0, np.float32))


# ---- Triton's answers, word for word, where its clients and examples match them -----------------------

UNKNOWN = "Request for unknown model: 'no_such_model' is not found"
BAD_VERSION = (
    "failed to get model version from specified version string '{}' (details: stol), "
    "version should be an integral value > 0"
)
VERSIONS = [
    ("7", NOT_FOUND, "Request for unknown model: 'add_sub' version 7 is not found"),
    ("0", NOT_FOUND, "Request for unknown model: 'add_sub' version 0 is not found"),
    ("abc", INVALID, BAD_VERSION.format("abc")),
    ("1.5", INVALID, BAD_VERSION.format("1.5")),  # Triton's std::stol would read version 1: refused here
    ("99999999999999999999", INVALID, BAD_VERSION.format("99999999999999999999")),  # past a 64-bit long
    ("-1", INVALID, "invalid model version specified '-1' , version should be an integral value > 0"),
]


def _failure(call: Callable[[], object]) -> tuple[str, str]:
    """(status, message) of a stock client call that must fail."""
    try:
        call()
    except InferenceServerException as exc:
        return str(exc.status()), str(exc.message())
    pytest.fail("the call succeeded")


def test_an_unknown_model_is_answered_as_triton_answers(daemon: RunningDaemon) -> None:
    c = daemon.client
    for what, call in {
        "infer": lambda: c.infer("no_such_model", _pair()),
        "metadata": lambda: c.get_model_metadata("no_such_model"),
        "config": lambda: c.get_model_config("no_such_model"),
    }.items():
        assert _failure(call) == (str(NOT_FOUND), UNKNOWN), what
    assert _failure(lambda: c.get_inference_statistics("no_such_model")) == (
        str(INVALID),
        "requested model 'no_such_model' is not available",
    )
    assert c.is_model_ready("no_such_model") is False  # not an error: Triton answers ready=false


@pytest.mark.parametrize(("version", "code", "message"), VERSIONS, ids=[v for v, _, _ in VERSIONS])
def test_versions_are_read_and_refused_as_triton_does(
    daemon: RunningDaemon, version: str, code: grpc.StatusCode, message: str
) -> None:
    c = daemon.client
    for what, call in {
        "infer": lambda: c.infer("add_sub", _pair(), model_version=version),
        "metadata": lambda: c.get_model_metadata("add_sub", version),
        "config": lambda: c.get_model_config("add_sub", version),
    }.items():
        assert _failure(call) == (str(code), message), what
    stats = _failure(lambda: c.get_inference_statistics("add_sub", version))
    ready = lambda: c.is_model_ready("add_sub", version)  # noqa: E731
    if code == NOT_FOUND:  # a version that is no number of the model's
        assert stats == (str(INVALID), "requested model version is not available for model 'add_sub'")
        assert ready() is False
    else:  # a string that is no version: refused by every call, before the model is looked up
        assert stats == (str(code), message)
        assert _failure(ready) == (str(code), message)
        assert _failure(lambda: c.get_model_metadata("no_such_model", version)) == (str(code), message)


def test_contents_beside_raw_input_contents_is_named_before_any_count(
    stub: service_pb2_grpc.GRPCInferenceServiceStub,
) -> None:
    """INPUT0 in typed contents, INPUT1 raw: one raw entry for two inputs, but the mix is what is wrong."""
    req = service_pb2.ModelInferRequest(model_name="add_sub")
    req.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 16]).contents.fp32_contents.extend([1.0] * 16)
    req.inputs.add(name="INPUT1", datatype="FP32", shape=[1, 16])
    req.raw_input_contents.append(np.ones(16, np.float32).tobytes())
    with pytest.raises(grpc.RpcError) as err:
        stub.ModelInfer(req, timeout=30)
    assert (err.value.code(), err.value.details()) == (  # type: ignore[attr-defined]
        INVALID,
        "contents field must not be specified when using raw_input_contents for 'INPUT0' for model 'add_sub'",
    )
