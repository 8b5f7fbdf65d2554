"""Cutting raw_input_contents out of a ModelInferRequest's wire bytes, and joining raw_output_contents onto a
ModelInferResponse's.

Messages are built with tritonclient's own generated classes, so the wire form is the client's; the
property: the rest of the message parses to the original without its raw contents, and the views are
the original entries, in order, whatever the fields and their order.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2 as pb

from mpsd.ipc.infer_wire import raw_output_parts, split_request

names = st.text(min_size=0, max_size=12)
tensors = st.builds(
    lambda name, dtype, shape: pb.ModelInferRequest.InferInputTensor(name=name, datatype=dtype, shape=shape),
    names,
    st.sampled_from(["FP32", "INT64", "BYTES"]),
    st.lists(st.integers(min_value=-1, max_value=2**40), max_size=4),
)


@st.composite
def requests(draw: st.DrawFn) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(
        model_name=draw(names),
        model_version=draw(st.sampled_from(["", "1", "12"])),
        id=draw(names),
        inputs=draw(st.lists(tensors, max_size=4)),
        raw_input_contents=draw(st.lists(st.binary(max_size=300), max_size=4)),
    )
    if draw(st.booleans()):
        request.parameters["priority"].int64_param = draw(st.integers(min_value=0, max_value=2**31))
    if draw(st.booleans()):
        request.outputs.add(name=draw(names))
    return request


@settings(max_examples=300, deadline=None)
@given(requests(), st.booleans())
def test_the_rest_parses_to_the_message_and_the_views_are_its_raw_contents(
    request: pb.ModelInferRequest, as_bytearray: bool
) -> None:
    data = request.SerializeToString(deterministic=True)
    split = split_request(bytearray(data) if as_bytearray else data)
    assert split is not None
    rest, raw = split.rest, split.raw
    assert [bytes(v) for v in raw] == list(request.raw_input_contents)
    expected = pb.ModelInferRequest()
    expected.CopyFrom(request)
    del expected.raw_input_contents[:]
    assert pb.ModelInferRequest.FromString(bytes(rest)) == expected


def test_a_raw_entry_placed_between_other_fields_is_found() -> None:
    head = pb.ModelInferRequest(model_name="m").SerializeToString()
    raw = pb.ModelInferRequest(raw_input_contents=[b"\x01\x02\x03"]).SerializeToString()
    tail = pb.ModelInferRequest(id="x").SerializeToString()
    split = split_request(raw + head + raw + tail)
    assert split is not None
    rest, views = split.rest, split.raw
    assert [bytes(v) for v in views] == [b"\x01\x02\x03", b"\x01\x02\x03"]
    assert pb.ModelInferRequest.FromString(bytes(rest)) == pb.ModelInferRequest(model_name="m", id="x")


@given(st.binary(max_size=64))
def test_malformed_bytes_are_left_to_protobuf(data: bytes) -> None:
    split = split_request(data)
    if split is not None:  # well-formed at the wire level; views lie inside the data
        assert len(split.rest) + sum(len(v) for v in split.raw) <= len(data)
        assert len(split.key) <= len(split.rest)


def test_truncated_messages_are_not_split() -> None:
    data = pb.ModelInferRequest(model_name="m", raw_input_contents=[b"x" * 100]).SerializeToString()
    for cut in (1, 5, 50):
        assert split_request(data[:-cut]) is None


Output = pb.ModelInferResponse.InferOutputTensor
outputs = st.builds(
    lambda name, dtype, shape: Output(name=name, datatype=dtype, shape=shape),
    names,
    st.sampled_from(["FP32", "INT64", "BF16"]),
    st.lists(st.integers(min_value=0, max_value=2**40), max_size=4),
)


@settings(max_examples=300, deadline=None)
@given(
    names,
    st.lists(outputs, max_size=4),
    # sizes around the varint boundaries (127/128, 16383/16384) and large entries
    st.lists(st.one_of(st.binary(max_size=300), st.integers(120, 20_000).map(bytes)), max_size=4),
    st.booleans(),
)
def test_a_joined_response_parses_as_the_message_with_its_raw_contents(
    model: str, outs: list[Output], contents: list[bytes], views: bool
) -> None:
    header = pb.ModelInferResponse(model_name=model, model_version="3", id="r", outputs=outs)
    header.parameters["p"].int64_param = 7
    # views of 4-byte items too, whose len() counts items, not bytes
    entries = [memoryview(c).cast("I" if len(c) % 4 == 0 else "B") for c in contents] if views else contents
    parts = raw_output_parts(header.SerializeToString(), entries)
    assert all(memoryview(p).nbytes for p in parts), "an empty piece would stall a scatter-gather send"
    joined = b"".join(parts)
    expected = pb.ModelInferResponse()
    expected.CopyFrom(header)
    expected.raw_output_contents.extend(contents)
    assert pb.ModelInferResponse.FromString(joined) == expected


@settings(max_examples=300, deadline=None)
@given(requests())
def test_the_key_is_the_message_without_raw_contents_and_id(request: pb.ModelInferRequest) -> None:
    data = request.SerializeToString(deterministic=True)
    split = split_request(data)
    assert split is not None
    assert [bytes(v) for v in split.raw] == list(request.raw_input_contents)
    assert split.request_id == (request.id.encode() if request.id else None)
    without = pb.ModelInferRequest()
    without.CopyFrom(request)
    del without.raw_input_contents[:]
    assert pb.ModelInferRequest.FromString(bytes(split.rest)) == without
    without.id = ""
    assert pb.ModelInferRequest.FromString(split.key) == without


def test_requests_that_differ_only_in_their_ids_share_a_key() -> None:
    def wire(rid: str) -> bytes:
        message = pb.ModelInferRequest(model_name="m", id=rid, raw_input_contents=[b"\x01"])
        data: bytes = message.SerializeToString()
        return data

    first, second = split_request(wire("a")), split_request(wire("bb"))
    assert first is not None and second is not None
    assert first.key == second.key and (first.request_id, second.request_id) == (b"a", b"bb")
