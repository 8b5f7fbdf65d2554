"""The scenarios of test_response_templates.py, run in a fresh interpreter (`python -m
tests.response_templates_scenarios NAME`): the daemon's gRPC messages and tritonclient's share protobuf
package names, so they cannot be loaded in one process, and the test process has tritonclient's."""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st

from mpsd.daemon.api.grpc import responses
from mpsd.daemon.api.grpc.responses import ResponseTemplates, infer_response_parts
from mpsd.daemon.dataplane.request import InferResult, OutputTensor
from mpsd.proto import grpc_service_pb2 as pb
from tests.fresh_interpreter import main

names = st.text(max_size=12)
ids = st.one_of(names, st.text(min_size=120, max_size=300))  # ids whose length takes a 2-byte varint
outputs = st.builds(
    OutputTensor,
    names,
    st.sampled_from(["FP32", "INT64", "BF16"]),
    st.lists(st.integers(min_value=0, max_value=2**40), max_size=4).map(tuple),
    st.one_of(st.binary(max_size=300), st.integers(120, 20_000).map(bytes)),
)
results = st.builds(
    lambda model, version, outs: InferResult(model, version, tuple(outs)),
    names,
    st.integers(min_value=0, max_value=2**20),
    st.lists(outputs, max_size=3),
)


def expected(
    result: InferResult, request_id: str, in_shm: frozenset[str] = frozenset()
) -> pb.ModelInferResponse:
    response, contents = infer_response_parts(result, request_id, in_shm)
    response.raw_output_contents.extend(contents)
    return response


def parsed(
    templates: ResponseTemplates, result: InferResult, request_id: str, in_shm: frozenset[str] = frozenset()
) -> pb.ModelInferResponse:
    return pb.ModelInferResponse.FromString(
        b"".join(bytes(p) for p in templates.parts(result, request_id, in_shm))
    )


SHARED = ResponseTemplates()  # one table across examples, as in the daemon: later examples hit entries


@settings(max_examples=400, deadline=None)
@given(results, ids, ids)
def every_response_parses_as_the_message_protobuf_builds(
    result: InferResult, first: str, second: str
) -> None:
    for templates in (ResponseTemplates(), SHARED):
        assert parsed(templates, result, first) == expected(result, first)
        assert parsed(templates, result, second) == expected(result, second)  # the same entry, another id


def another_shape_or_version_is_another_header() -> None:
    templates = ResponseTemplates()
    out = OutputTensor("y", "FP32", (2, 4), bytes(32))
    assert parsed(templates, InferResult("m", 1, (out,)), "a").outputs[0].shape == [2, 4]
    wider = OutputTensor("y", "FP32", (4, 4), bytes(64))
    assert parsed(templates, InferResult("m", 1, (wider,)), "b").outputs[0].shape == [4, 4]
    assert parsed(templates, InferResult("m", 2, (out,)), "c").model_version == "2"
    assert parsed(templates, InferResult("n", 1, (out,)), "d").model_name == "n"
    assert len(templates) == 4


def outputs_in_shared_memory_keep_their_place_empty() -> None:
    templates = ResponseTemplates()
    result = InferResult(
        "m", 1, (OutputTensor("x", "FP32", (1,), bytes(4)), OutputTensor("y", "FP32", (1,), b"\x01" * 4))
    )
    response = parsed(templates, result, "r", frozenset({"x"}))
    assert response == expected(result, "r", frozenset({"x"}))
    assert list(response.raw_output_contents) == [b"", b"\x01" * 4]


def the_table_is_bounded() -> None:
    templates = ResponseTemplates()
    for k in range(responses.MAX_TEMPLATES + 5):
        out = OutputTensor("y", "FP32", (k,), bytes(4 * k))
        assert parsed(templates, InferResult("m", 1, (out,)), "r").outputs[0].shape == [k]
    assert 0 < len(templates) <= responses.MAX_TEMPLATES


SCENARIOS: dict[str, Callable[[], None]] = {
    "parses": every_response_parses_as_the_message_protobuf_builds,
    "keys": another_shape_or_version_is_another_header,
    "shm": outputs_in_shared_memory_keep_their_place_empty,
    "bounded": the_table_is_bounded,
}

if __name__ == "__main__":
    main(SCENARIOS)
