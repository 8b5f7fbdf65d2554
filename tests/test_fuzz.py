"""Random malformed requests through the real daemon (hypothesis).

Every request ends in a clean status (never INTERNAL or UNKNOWN, never a hang: each call has a deadline),
the daemon and its workers stay up with the same pids, nothing unexpected is logged, and a valid request
afterwards succeeds.

CI runs a bounded, derandomized set of examples; `MPSD_FUZZ_EXAMPLES=5000` runs a longer search and
`MPSD_FUZZ_SEED=<n>` a different one (see docs/security.md).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2, service_pb2_grpc

from tests import models
from tests.conftest import RunningDaemon

EXAMPLES = int(os.environ.get("MPSD_FUZZ_EXAMPLES", "60"))
SEED = os.environ.get("MPSD_FUZZ_SEED")
CALL_TIMEOUT_S = 30.0
CLEAN = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.UNIMPLEMENTED,
}
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=SEED is None,  # the same examples on every CI run unless a seed is asked for
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)


def fuzz(test: Callable[..., None]) -> Callable[..., None]:
    test = SETTINGS(test)
    return seed(int(SEED))(test) if SEED is not None else test


DATATYPES = ["BOOL", "UINT8", "INT8", "INT16", "INT32", "INT64", "UINT16", "UINT32", "UINT64"]
DATATYPES += ["FP16", "BF16", "FP32", "FP64", "BYTES", "", "FP8", "fp32", "TYPE_FP32"]
TYPED_FIELDS = [
    "bool_contents",
    "int_contents",
    "int64_contents",
    "uint_contents",
    "uint64_contents",
    "fp32_contents",
    "fp64_contents",
    "bytes_contents",
]
PARAMETER_NAMES = ["sequence_id", "sequence_start", "sequence_end", "priority", "timeout", "headers"]
PARAMETER_NAMES += ["binary_data_output", "binary_data", "binary_data_size", "classification"]
PARAMETER_NAMES += ["shared_memory_region", "shared_memory_offset", "shared_memory_byte_size", "zz"]


@dataclass
class Fuzzed:
    daemon: RunningDaemon
    stub: service_pb2_grpc.GRPCInferenceServiceStub
    channel: grpc.Channel
    pids: list[int]


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fuzzed]:
    base = tmp_path_factory.mktemp("fuzz")
    repo = base / "repo"
    models.add_sub(repo)  # INPUT0/INPUT1 FP32 [16], max_batch_size 8
    models.identity(repo, "vec", "TYPE_INT32", [-1])  # variable length, no batch dimension
    d = RunningDaemon(repo, base / "daemon.log", extra_args=["--metrics-address", ""])
    channel = grpc.insecure_channel(d.address)
    try:
        d.wait_ready()
        pids = sorted(d.worker_pids())
        assert len(pids) == 2
        yield Fuzzed(d, service_pb2_grpc.GRPCInferenceServiceStub(channel), channel, pids)
    finally:
        channel.close()
        d.stop()
        d.kill_group()


# ---- strategies ----------------------------------------------------------------------------------------

names = st.one_of(
    st.sampled_from(["add_sub", "vec", "INPUT0", "INPUT1", "IN", "OUT", "OUTPUT0", ""]),
    st.text(max_size=40),
    st.text(min_size=250, max_size=300),
)
dims = st.one_of(
    st.integers(-3, 20),
    st.sampled_from([0, 8, 9, 16, 1000, 2**31, 2**32 + 1, 2**62, 2**63 - 1, -(2**63)]),
)
int64s = st.integers(-(2**63), 2**63 - 1)


def parameter_values(draw: st.DrawFn, target: Any) -> None:
    kind = draw(st.sampled_from(["bool", "int64", "uint64", "string", "double", "none"]))
    if kind == "bool":
        target.bool_param = draw(st.booleans())
    elif kind == "int64":
        target.int64_param = draw(int64s)
    elif kind == "uint64":
        target.uint64_param = draw(st.integers(0, 2**64 - 1))
    elif kind == "string":
        target.string_param = draw(st.text(max_size=20))
    elif kind == "double":
        target.double_param = draw(st.floats(allow_nan=True))


def add_parameter(draw: st.DrawFn, parameters: Any) -> None:
    key = draw(st.one_of(st.sampled_from(PARAMETER_NAMES), st.text(max_size=20)))
    parameter_values(draw, parameters[key])


def typed_values(draw: st.DrawFn, field: str) -> list[Any]:
    size = st.integers(0, 40)
    n = draw(size)
    if field == "bool_contents":
        return draw(st.lists(st.booleans(), min_size=n, max_size=n))
    if field == "int_contents":
        return draw(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=n, max_size=n))
    if field == "int64_contents":
        return draw(st.lists(int64s, min_size=n, max_size=n))
    if field == "uint_contents":
        return draw(st.lists(st.integers(0, 2**32 - 1), min_size=n, max_size=n))
    if field == "uint64_contents":
        return draw(st.lists(st.integers(0, 2**64 - 1), min_size=n, max_size=n))
    if field in ("fp32_contents", "fp64_contents"):
        width = 32 if field == "fp32_contents" else 64
        return draw(st.lists(st.floats(width=width), min_size=n, max_size=n))
    return draw(st.lists(st.binary(max_size=8), min_size=n, max_size=n))


def valid_request(model: str) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name=model, id="fuzz")
    if model == "add_sub":
        for name in ("INPUT0", "INPUT1"):
            request.inputs.add(name=name, datatype="FP32", shape=[2, 16])
            request.raw_input_contents.append(np.ones((2, 16), np.float32).tobytes())
    else:
        tensor = request.inputs.add(name="IN", datatype="INT32", shape=[5])
        tensor.contents.int_contents.extend([1, 2, 3, 4, 5])
    return request


def _pick_input(draw: st.DrawFn, request: Any) -> Any | None:
    if not request.inputs:
        return None
    return request.inputs[draw(st.integers(0, len(request.inputs) - 1))]


def m_model(draw: st.DrawFn, r: Any) -> None:
    r.model_name = draw(names)


def m_version(draw: st.DrawFn, r: Any) -> None:
    r.model_version = draw(st.one_of(st.sampled_from(["1", "2", "0", "-1", "01", "x"]), st.text(max_size=30)))


def m_id(draw: st.DrawFn, r: Any) -> None:
    r.id = draw(st.one_of(st.text(max_size=50), st.just("i" * 5000)))


def m_request_parameter(draw: st.DrawFn, r: Any) -> None:
    add_parameter(draw, r.parameters)


def m_input_name(draw: st.DrawFn, r: Any) -> None:
    if (t := _pick_input(draw, r)) is not None:
        t.name = draw(names)


def m_datatype(draw: st.DrawFn, r: Any) -> None:
    if (t := _pick_input(draw, r)) is not None:
        t.datatype = draw(st.one_of(st.sampled_from(DATATYPES), st.text(max_size=10)))


def m_shape(draw: st.DrawFn, r: Any) -> None:
    if (t := _pick_input(draw, r)) is not None:
        del t.shape[:]
        t.shape.extend(draw(st.lists(dims, max_size=18)))


def m_raw(draw: st.DrawFn, r: Any) -> None:
    if r.raw_input_contents:
        i = draw(st.integers(0, len(r.raw_input_contents) - 1))
        r.raw_input_contents[i] = draw(st.binary(max_size=200))
    else:
        r.raw_input_contents.append(draw(st.binary(max_size=200)))


def m_raw_count(draw: st.DrawFn, r: Any) -> None:
    if r.raw_input_contents and draw(st.booleans()):
        del r.raw_input_contents[-1]
    else:
        r.raw_input_contents.append(draw(st.binary(max_size=64)))


def m_typed(draw: st.DrawFn, r: Any) -> None:
    if (t := _pick_input(draw, r)) is not None:
        field = draw(st.sampled_from(TYPED_FIELDS))
        getattr(t.contents, field).extend(typed_values(draw, field))


def m_tensor_parameter(draw: st.DrawFn, r: Any) -> None:
    if (t := _pick_input(draw, r)) is not None:
        add_parameter(draw, t.parameters)


def m_extra_input(draw: st.DrawFn, r: Any) -> None:
    t = r.inputs.add(name=draw(names), datatype=draw(st.sampled_from(DATATYPES)))
    t.shape.extend(draw(st.lists(dims, max_size=4)))


def m_drop_input(draw: st.DrawFn, r: Any) -> None:
    if r.inputs:
        del r.inputs[-1]


def m_output(draw: st.DrawFn, r: Any) -> None:
    out = r.outputs.add(name=draw(names))
    if draw(st.booleans()):
        add_parameter(draw, out.parameters)


MUTATIONS: list[Callable[[st.DrawFn, Any], None]] = [
    m_model,
    m_version,
    m_id,
    m_request_parameter,
    m_input_name,
    m_datatype,
    m_shape,
    m_raw,
    m_raw_count,
    m_typed,
    m_tensor_parameter,
    m_extra_input,
    m_drop_input,
    m_output,
]


@st.composite
def infer_requests(draw: st.DrawFn) -> service_pb2.ModelInferRequest:
    """A valid request for one of the models with one to four random mutations."""
    request = valid_request(draw(st.sampled_from(["add_sub", "vec"])))
    for mutate in draw(st.lists(st.sampled_from(MUTATIONS), min_size=1, max_size=4)):
        mutate(draw, request)
    return request


# ---- checks ----------------------------------------------------------------------------------------------


def status(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code(), str(exc.details())
    return grpc.StatusCode.OK, ""


def assert_unharmed(f: Fuzzed) -> None:
    """Same daemon, same workers, nothing unexpected logged, and a valid request still works."""
    assert f.daemon.proc.poll() is None, f.daemon.log()
    assert sorted(f.daemon.worker_pids()) == f.pids
    log = f.daemon.log()
    for bad in ("unexpected error", "Traceback", "Unexpected ["):
        assert bad not in log, log[-4000:]
    reply = f.stub.ModelInfer(valid_request("add_sub"), timeout=CALL_TIMEOUT_S)
    out = np.frombuffer(reply.raw_output_contents[0], np.float32)
    np.testing.assert_array_equal(out, np.full(32, 2.0, np.float32))


# ---- the properties -------------------------------------------------------------------------------------


def test_random_malformed_requests_end_in_a_clean_status(fuzzed: Fuzzed) -> None:
    seen: dict[grpc.StatusCode, int] = {}

    @fuzz
    @given(request=infer_requests())
    def one(request: service_pb2.ModelInferRequest) -> None:
        code, message = status(lambda: fuzzed.stub.ModelInfer(request, timeout=CALL_TIMEOUT_S))
        assert code in CLEAN, f"{code}: {message}\n{request}"
        if code != grpc.StatusCode.OK:
            assert message, f"{code} without a message"
        seen[code] = seen.get(code, 0) + 1

    one()
    assert seen.get(grpc.StatusCode.INVALID_ARGUMENT, 0) > 0, seen  # the search reached validation
    assert_unharmed(fuzzed)


def test_random_requests_in_one_stream_are_answered_in_order(fuzzed: Fuzzed) -> None:
    @fuzz
    @given(requests=st.lists(infer_requests(), min_size=1, max_size=4))
    def one(requests: list[service_pb2.ModelInferRequest]) -> None:
        for i, request in enumerate(requests):
            request.id = f"r{i}"
        responses: list[Any] = []

        def call() -> None:
            responses.extend(fuzzed.stub.ModelStreamInfer(iter(requests), timeout=CALL_TIMEOUT_S))

        code, message = status(call)
        assert code == grpc.StatusCode.OK, f"{code}: {message}"
        assert [r.infer_response.id for r in responses] == [r.id for r in requests]

    one()
    assert_unharmed(fuzzed)


def test_random_bytes_end_in_a_clean_status(fuzzed: Fuzzed) -> None:
    infer = fuzzed.channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
    metadata = fuzzed.channel.unary_unary("/inference.GRPCInferenceService/ModelMetadata")

    @fuzz
    @given(payload=st.binary(max_size=300), to_infer=st.booleans())
    def one(payload: bytes, to_infer: bool) -> None:
        method = infer if to_infer else metadata
        code, message = status(lambda: method(payload, timeout=CALL_TIMEOUT_S))
        assert code in CLEAN, f"{code}: {message}\n{payload!r}"

    one()
    assert_unharmed(fuzzed)
