"""Limits on what a request may declare and carry: each bad request is refused with its status and a
message before anything is allocated from what it declares, and none disturbs the daemon or its workers.

The daemon here runs with a 64 KiB message limit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests import models
from tests.conftest import RunningDaemon, serving

LIMIT = 64 * 1024
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    base = tmp_path_factory.mktemp("limits")
    repo = base / "repo"
    models.identity(repo, "vec", "TYPE_FP32", [-1])
    models.identity(repo, "mat", "TYPE_FP32", [-1, -1])
    models.python_model(repo, "grow", "return {'y': inputs['x'].repeat(8)}")
    config = base / "mpsd.yaml"
    config.write_text(yaml.safe_dump({"max_message_bytes": LIMIT, "metrics_address": ""}))
    with serving(repo, base / "daemon.log", config=config) as d:
        yield d


@pytest.fixture(scope="module")
def stub(daemon: RunningDaemon) -> Iterator[service_pb2_grpc.GRPCInferenceServiceStub]:
    channel = grpc.insecure_channel(daemon.address)
    try:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)
    finally:
        channel.close()


def vector(n: int, name: str = "IN") -> list[grpcclient.InferInput]:
    inp = grpcclient.InferInput(name, [n], "FP32")
    inp.set_data_from_numpy(np.ones(n, np.float32))
    return [inp]


def refused(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    try:
        call()
    except InferenceServerException as exc:
        return getattr(grpc.StatusCode, str(exc.status()).rsplit(".", 1)[-1]), str(exc.message())
    except grpc.RpcError as exc:
        return exc.code(), str(exc.details())
    pytest.fail("the request was accepted")


def raw_request(
    model: str, shape: list[int], data: bytes | None = b"", name: str = "IN"
) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name=model)
    request.inputs.add(name=name, datatype="FP32", shape=shape)
    if data is not None:
        request.raw_input_contents.append(data)
    return request


# ---- message size ------------------------------------------------------------------------------------


def test_request_over_the_message_limit_is_resource_exhausted(daemon: RunningDaemon) -> None:
    code, message = refused(lambda: daemon.client.infer("vec", vector(LIMIT // 4)))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, message
    assert str(LIMIT) in message
    result = daemon.client.infer("vec", vector(LIMIT // 8))  # half the limit passes
    assert result.as_numpy("OUT").shape == (LIMIT // 8,)


def test_response_over_the_message_limit_is_resource_exhausted(daemon: RunningDaemon) -> None:
    code, message = refused(lambda: daemon.client.infer("grow", vector(LIMIT // 16, "x")))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, message
    result = daemon.client.infer("grow", vector(16, "x"))
    assert result.as_numpy("y").shape == (128,)


# ---- declared sizes ---------------------------------------------------------------------------------------


def test_huge_declared_shape_in_a_small_request_is_refused(
    stub: service_pb2_grpc.GRPCInferenceServiceStub,
) -> None:
    request = raw_request("vec", [10**12], bytes(100))
    assert request.ByteSize() < 200
    code, message = refused(lambda: stub.ModelInfer(request, timeout=30))
    assert code == INVALID, message
    assert "100 bytes" in message and "expected 4000000000000" in message

    typed = raw_request("vec", [10**12], None)
    typed.inputs[0].contents.fp32_contents.extend([1.0] * 25)
    code, message = refused(lambda: stub.ModelInfer(typed, timeout=30))
    assert code == INVALID, message
    assert "25 elements" in message and "expected 1000000000000" in message


@pytest.mark.parametrize("shape", [[2**62, 2**62], [0, 2**62], [2**63 - 1, 2]])
def test_shape_whose_byte_size_overflows_is_refused(
    stub: service_pb2_grpc.GRPCInferenceServiceStub, shape: list[int]
) -> None:
    code, message = refused(lambda: stub.ModelInfer(raw_request("mat", shape), timeout=30))
    assert code == INVALID, message
    assert "overflows 64 bits" in message and "IN" in message


def test_a_shape_of_more_than_16_dimensions_is_refused(
    stub: service_pb2_grpc.GRPCInferenceServiceStub,
) -> None:
    """docs/security.md: at most 16 dimensions, checked before the config's dims are compared."""
    code, message = refused(lambda: stub.ModelInfer(raw_request("mat", [1] * 17), timeout=30))
    assert code == INVALID and "shape has 17 dimensions; the limit is 16" in message, message


def test_negative_dimension_is_refused(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    code, message = refused(lambda: stub.ModelInfer(raw_request("vec", [-4]), timeout=30))
    assert code == INVALID and "negative" in message, message


def test_raw_and_typed_contents_together_are_refused(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    request = raw_request("vec", [2], np.ones(2, np.float32).tobytes())
    request.inputs[0].contents.fp32_contents.extend([1.0, 1.0])
    code, message = refused(lambda: stub.ModelInfer(request, timeout=30))
    assert (code, message) == (
        INVALID,
        "contents field must not be specified when using raw_input_contents for 'IN' for model 'vec'",
    )


# ---- parameters ----------------------------------------------------------------------------------------


def test_known_request_parameters_are_accepted(daemon: RunningDaemon) -> None:
    result = daemon.client.infer(
        "vec", vector(4), sequence_id=7, sequence_start=True, sequence_end=True, priority=1, timeout=10**6
    )
    assert result.as_numpy("OUT").shape == (4,)


def test_unknown_request_parameters_are_refused_by_name(daemon: RunningDaemon) -> None:
    code, message = refused(
        lambda: daemon.client.infer("vec", vector(4), parameters={"turbo": True, "zz": 1})
    )
    assert code == INVALID, message
    assert "'turbo'" in message and "'zz'" in message and "sequence_id" in message


def test_request_parameter_of_the_wrong_kind_is_refused(
    stub: service_pb2_grpc.GRPCInferenceServiceStub,
) -> None:
    request = raw_request("vec", [1], np.ones(1, np.float32).tobytes())
    request.parameters["sequence_start"].string_param = "yes"
    code, message = refused(lambda: stub.ModelInfer(request, timeout=30))
    assert code == INVALID and "sequence_start" in message and "bool" in message, message


def test_unknown_tensor_parameters_are_refused(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    request = raw_request("vec", [1], np.ones(1, np.float32).tobytes())
    request.inputs[0].parameters["compression"].string_param = "zstd"
    code, message = refused(lambda: stub.ModelInfer(request, timeout=30))
    assert code == INVALID and "input 'IN'" in message and "'compression'" in message, message
    request = raw_request("vec", [1], np.ones(1, np.float32).tobytes())
    request.outputs.add(name="OUT").parameters["format"].string_param = "png"
    code, message = refused(lambda: stub.ModelInfer(request, timeout=30))
    assert code == INVALID and "output 'OUT'" in message and "'format'" in message, message


# ---- names ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "input_name", "words"),
    [
        ("vec", "IN\x00", ("input name", "unprintable")),
        ("vec", "IN\n", ("input name", "unprintable")),
        ("vec\x07", "IN", ("model name", "unprintable")),
        ("v" * 300, "IN", ("model name", "300 characters", "256")),
        ("v" * 50_000, "IN", ("model name", "50000 characters")),
        ("vec", "I" * 1000, ("input name", "1000 characters")),
    ],
)
def test_bad_names_are_refused_with_a_message(
    stub: service_pb2_grpc.GRPCInferenceServiceStub, model: str, input_name: str, words: tuple[str, ...]
) -> None:
    request = raw_request(model, [1], np.ones(1, np.float32).tobytes(), name=input_name)
    code, message = refused(lambda: stub.ModelInfer(request, timeout=30))
    assert code == INVALID, message
    for word in words:
        assert word in message, message


def test_huge_name_echoed_in_an_error_is_cut_not_a_broken_call(
    stub: service_pb2_grpc.GRPCInferenceServiceStub,
) -> None:
    name = "m" * 50_000  # under the message limit, far over what a trailer carries
    code, message = refused(
        lambda: stub.ModelMetadata(service_pb2.ModelMetadataRequest(name=name), timeout=30)
    )
    assert code == grpc.StatusCode.NOT_FOUND, message
    assert len(message) < 4000 and "bytes cut" in message


def test_overlong_request_id_is_refused(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    request = raw_request("vec", [1], np.ones(1, np.float32).tobytes())
    request.id = "r" * 5000
    code, message = refused(lambda: stub.ModelInfer(request, timeout=30))
    assert code == INVALID and "request id" in message, message


def test_bytes_that_are_not_a_message_are_invalid_argument(daemon: RunningDaemon) -> None:
    """A string field holding bytes that are not UTF-8, and a corrupt wire format."""
    with grpc.insecure_channel(daemon.address) as channel:
        infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        for payload in (b"\x0a\x03\xff\xfe\xfd", b"\xff\xff\xff\xff"):
            code, message = refused(lambda p=payload: infer(p, timeout=30))
            assert code == INVALID, message
            assert "not a valid protobuf message" in message
        stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")
        code, message = refused(lambda: list(stream(iter([b"\x0a\x01\xff"]), timeout=30)))
        assert code == INVALID, message


def test_refusals_leave_the_daemon_and_workers_untouched(
    daemon: RunningDaemon, stub: service_pb2_grpc.GRPCInferenceServiceStub
) -> None:
    pids = sorted(daemon.worker_pids())
    assert len(pids) == 3
    for shape in ([10**12], [2**62, 2**62], [-1]):
        refused(lambda s=shape: stub.ModelInfer(raw_request("vec", s, bytes(8)), timeout=30))
    refused(lambda: daemon.client.infer("vec", vector(LIMIT // 4)))
    assert daemon.proc.poll() is None
    assert sorted(daemon.worker_pids()) == pids
    x = np.arange(5, dtype=np.float32)
    inp = grpcclient.InferInput("IN", [5], "FP32")
    inp.set_data_from_numpy(x)
    np.testing.assert_array_equal(daemon.client.infer("vec", [inp]).as_numpy("OUT"), x)
