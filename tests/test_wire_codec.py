"""The binary layout of the per-request worker messages: every field comes back exactly, from a full parse
and from the caches, anything the layout cannot hold goes as a pickle, and a damaged frame is an error."""

from __future__ import annotations

import dataclasses
import socket
import struct
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpsd.ipc import protocol as p
from mpsd.ipc import wire_codec as w
from mpsd.ipc.framing import FrameProtocol, FrameReader, encode, recv_blocking

IN = p.RegionRef("/mpsd-1234-5f3a9c01", 1 << 20)
OUT = p.RegionRef("/mpsd-1234-77be0d42", 4 << 20)
X = p.TensorRef("INPUT0", "FP32", (1, 16), 64, 64)
LONG = "n" * 5000
UNICODE = "входной_тензор·画像·🙂"

BINARY: dict[str, object] = {
    "infer": p.Infer(7, (X,), ("OUTPUT0",), IN, OUT, 1, 1_234_567_890_123, 3),
    "infer, defaults": p.Infer(8, (X,), ("OUTPUT0",), IN, OUT),
    "infer, no outputs": p.Infer(9, (X,), (), IN, OUT),
    "infer, no inputs": p.Infer(10, (), ("A",), IN, OUT),
    "infer, several inputs": p.Infer(
        11,
        (
            X,
            p.TensorRef("MASK", "BOOL", (4, 1, 7), 128, 28),
            p.TensorRef("IDS", "INT64", (4, 100), 192, 3200),
        ),
        ("logits", "hidden", "attn"),
        IN,
        OUT,
        0,
    ),
    "infer, long and unicode names": p.Infer(
        12,
        (p.TensorRef(LONG, "BYTES", (2,), 64, 30), p.TensorRef(UNICODE, "FP16", (3,), 128, 6)),
        (UNICODE, LONG, ""),
        p.RegionRef("/" + UNICODE, 4096),
        OUT,
    ),
    "infer, odd shapes": p.Infer(
        13,
        (
            p.TensorRef("scalar", "FP32", (), 64, 4),
            p.TensorRef("neg", "FP32", (-1, 3, -(2**63)), 0, 0),
            p.TensorRef("big", "INT8", (2**63 - 1, 2**40), 2**62, 2**63 - 1),
            p.TensorRef("many dims", "FP32", tuple(range(1, 13)), 128, 0),
            p.TensorRef("empty", "FP32", (0, 5), 64, 0),
        ),
        ("y",),
        IN,
        OUT,
    ),
    "infer, extreme ints": p.Infer(2**63 - 1, (X,), ("y",), IN, p.RegionRef("", 0), -1, -(2**63), 0),
    "infer, a batch of images in fronts' arenas": p.Infer(
        14,
        (p.TensorRef("input", "FP16", (64, 3, 224, 224), 64, 64 * 301056),),
        ("logits",),
        IN,
        OUT,
        1,
        5,
        64,
        pieces=tuple(p.Piece(0, 1 + k % 3, k * 303104, 64 + k * 301056, 301056) for k in range(64)),
    ),
    "infer, extreme pieces": p.Infer(
        15,
        (X,),
        ("y",),
        IN,
        OUT,
        pieces=(p.Piece(2**63 - 1, -(2**63), 0, -1, 2**63 - 1), p.Piece(0, 0, 0, 0, 0)),
    ),
    "done, on the CPU": p.InferDone(
        7, (p.TensorRef("OUTPUT0", "FP32", (1, 16), 0, 64),), 10, 20, 30, 40, None
    ),
    "done, device time": p.InferDone(
        7, (p.TensorRef("OUTPUT0", "FP32", (1, 16), 0, 64),), 10, 20, 30, 40, 50
    ),
    "done, device time 0": p.InferDone(7, (p.TensorRef("OUTPUT0", "FP32", (1, 16), 0, 64),), 1, 2, 3, 4, 0),
    "done, defaults": p.InferDone(7, (p.TensorRef("OUTPUT0", "FP32", (1, 16), 0, 64),), 1, 2, 3),
    "done, no outputs": p.InferDone(99, (), 0, 5, 0, 0, None),
    "done, several outputs": p.InferDone(
        5,
        (p.TensorRef(UNICODE, "FP16", (8, 1000), 0, 16000), p.TensorRef(LONG, "BYTES", (-1,), 16000, 9)),
        1,
        2,
        3,
        4,
        2**63 - 1,
    ),
    "failed": p.InferFailed(7, "INTERNAL", "RuntimeError: shape mismatch"),
    "failed, unicode and empty": p.InferFailed(0, "", UNICODE),
    "failed, long": p.InferFailed(3, "RESOURCE_EXHAUSTED", "x" * 200_000),  # past both ends' 64 KiB buffers
    "stream part": p.StreamPart(4, 2, (p.TensorRef("tok", "INT64", (1, 1), 0, 8),)),
    "stream part, no outputs": p.StreamPart(4, 0, ()),
    "stream ack": p.StreamAck(4, 2),
    "stream ack, stop": p.StreamAck(4, 3, stop=True),
}
KINDS = {
    p.Infer: w.INFER,
    p.InferDone: w.INFER_DONE,
    p.InferFailed: w.INFER_FAILED,
    p.StreamPart: w.STREAM_PART,
    p.StreamAck: w.STREAM_ACK,
}


@pytest.fixture(autouse=True)
def cold_caches() -> Iterator[None]:
    w.clear_caches()
    yield
    w.clear_caches()


def _exact(value: object) -> object:
    """A value with its types spelled out, nested objects included: 1 == True and (1,) == [1] would hide a
    field that came back as another type."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return type(value), {f.name: _exact(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return type(value), [_exact(v) for v in value]
    return type(value), value


@pytest.mark.parametrize("message", BINARY.values(), ids=BINARY.keys())
def test_each_per_request_message_round_trips_in_its_binary_layout(message: object) -> None:
    payload = w.dumps(message)
    assert payload[0] == KINDS[type(message)], "binary, not a pickle"
    parsed = w.loads(payload)  # cold: a full parse
    # from the cache, out of a view into a reused buffer as both ends' readers hand it over
    cached = w.loads(memoryview(bytearray(payload)))
    for got in (parsed, cached):
        assert _exact(got) == _exact(message)
    if isinstance(message, (p.Infer, p.InferDone, p.StreamPart)):
        assert vars(cached)["outputs"] is vars(parsed)["outputs"], "the variable part came from the cache"
    assert w.dumps(message) == payload, "the encoder's cache gives the same bytes"


def test_device_time_none_and_zero_stay_apart() -> None:
    ref = p.TensorRef("y", "FP32", (1,), 0, 4)
    for device in (None, 0, 17):
        got = w.loads(w.dumps(p.InferDone(1, (ref,), 1, 2, 3, 4, device)))
        assert isinstance(got, p.InferDone)
        assert _exact(got.device_compute_ns) == _exact(device)


def test_the_caches_tell_apart_messages_that_differ_in_any_field() -> None:
    """The encoder's cache is keyed by field values and the decoder's by bytes: a field the key missed would
    bring back the previous message's value."""
    base = BINARY["infer, several inputs"]
    assert isinstance(base, p.Infer)
    variants: list[object] = [
        base,
        dataclasses.replace(base, outputs=("logits", "hidden")),
        dataclasses.replace(base, outputs=("logits", "hidden", "attn2")),
        dataclasses.replace(base, input_region=p.RegionRef(IN.name, IN.size * 2)),
        dataclasses.replace(base, input_region=p.RegionRef(IN.name + "x", IN.size)),
        dataclasses.replace(base, output_region=p.RegionRef(OUT.name, OUT.size + 4096)),
        dataclasses.replace(base, output_region=p.RegionRef(IN.name, OUT.size)),
        dataclasses.replace(base, inputs=base.inputs[:2]),
        dataclasses.replace(base, req_id=12, seat=1, sent_ns=5, requests=4),
    ]
    for field in ("name", "datatype", "shape", "offset", "nbytes"):
        changed = {"name": "MASK2", "datatype": "UINT8", "shape": (4, 1, 8), "offset": 130, "nbytes": 32}
        ref = dataclasses.replace(base.inputs[1], **{field: changed[field]})
        variants.append(dataclasses.replace(base, inputs=(base.inputs[0], ref, base.inputs[2])))
    done = p.InferDone(1, (p.TensorRef("y", "FP32", (2, 3), 0, 24),), 1, 2, 3)
    for field, value in (
        ("name", "z"),
        ("datatype", "FP64"),
        ("shape", (3, 2)),
        ("offset", 8),
        ("nbytes", 4),
    ):
        variants.append(
            dataclasses.replace(done, outputs=(dataclasses.replace(done.outputs[0], **{field: value}),))
        )
    variants.append(p.StreamPart(1, 0, done.outputs))
    variants.append(p.StreamPart(1, 1, (dataclasses.replace(done.outputs[0], shape=(1, 6)),)))
    for _ in range(2):  # the second time round, every tail comes from the caches
        for message in variants:
            assert w.loads(w.dumps(message)) == message


def test_the_caches_stay_bounded() -> None:
    for i in range(w.CACHE_ENTRIES * 2 + 5):
        message = p.InferDone(i, (p.TensorRef("y", "FP32", (i,), 0, 4 * i),), 1, 2, 3)
        assert w.loads(w.dumps(message)) == message
    assert 0 < len(w._refs_tails) <= w.CACHE_ENTRIES
    assert 0 < len(w._refs_parts) <= w.CACHE_ENTRIES


PICKLED: dict[str, object] = {
    "need output": p.NeedOutput(3, 2**40),
    "output region": p.OutputRegion(OUT),
    "shutdown": p.Shutdown(),
    "memory": p.MemorySnapshot({"rss": 5}),
    "profile chunk": p.ProfileChunk(1, "trace.json", b"\x00\x80" * 10),
    "ready": p.Ready(123, {"type": "cpu"}, 1.5, 2.5),
    # per-request kinds with a value the layout cannot hold
    "req_id past int64": p.StreamAck(2**64, 1),
    "offset past int64": p.InferDone(1, (p.TensorRef("y", "FP32", (1,), 2**63, 4),), 1, 2, 3),
    "negative past int64": p.Infer(1, (p.TensorRef("y", "FP32", (-(2**63) - 1,), 0, 4),), (), IN, OUT),
    "piece past int64": p.Infer(1, (X,), ("y",), IN, OUT, pieces=(p.Piece(0, 1, 2**63, 64, 4),)),
    "device time past int64": p.InferDone(1, (), 1, 2, 3, 4, 2**70),
    "name past 65535 bytes": p.Infer(1, (X,), ("é" * 40_000,), IN, OUT),
    "lone surrogate": p.InferFailed(1, "INTERNAL", "bad byte \udc80"),
    "shape as a list": p.InferDone(1, (p.TensorRef("y", "FP32", [1, 2], 0, 8),), 1, 2, 3),  # type: ignore[arg-type]
}


@pytest.mark.parametrize("message", PICKLED.values(), ids=PICKLED.keys())
def test_everything_else_goes_as_a_pickle(message: object) -> None:
    payload = w.dumps(message)
    assert payload[0] == w.PICKLED
    got = w.loads(memoryview(payload))
    assert got == message
    assert _exact(got) == _exact(message)


@pytest.mark.parametrize("message", BINARY.values(), ids=BINARY.keys())
def test_a_truncated_or_padded_binary_frame_is_an_error(message: object) -> None:
    payload = w.dumps(message)
    w.loads(payload)  # its tail is now cached: a damaged frame must not be taken for it
    step = max(1, len(payload) // 200)
    for n in [*range(0, len(payload), step), len(payload) - 1]:
        with pytest.raises(w.MalformedFrame):
            w.loads(payload[:n])
    with pytest.raises(w.MalformedFrame):
        w.loads(payload + b"\x00")


def test_an_unknown_kind_or_bad_text_is_an_error() -> None:
    for kind in (0, 6, 0x7F, 0xFF):
        with pytest.raises(w.MalformedFrame, match="unknown frame kind"):
            w.loads(bytes([kind]) + b"\x00" * 40)
    bad = bytearray(w.dumps(p.InferFailed(1, "INTERNAL", "ok")))
    bad[-1] = 0xFF  # not UTF-8
    with pytest.raises(w.MalformedFrame):
        w.loads(bytes(bad))
    assert issubclass(w.MalformedFrame, ValueError)


@settings(max_examples=300, deadline=None)
@given(kind=st.sampled_from(sorted(KINDS.values())), body=st.binary(max_size=300))
def test_garbage_after_a_kind_byte_parses_or_fails_cleanly(kind: int, body: bytes) -> None:
    try:
        got = w.loads(bytes([kind]) + body)
    except w.MalformedFrame:
        return
    assert type(got) in KINDS
    assert w.loads(w.dumps(got)) == got


NAMES = st.text(max_size=40)
REFS = st.lists(
    st.builds(
        p.TensorRef,
        NAMES,
        st.sampled_from(["FP32", "FP16", "INT64", "BYTES", "BOOL"]),
        st.lists(st.integers(-(2**63), 2**63 - 1), max_size=10).map(tuple),
        st.integers(0, 2**63 - 1),
        st.integers(0, 2**63 - 1),
    ),
    max_size=4,
).map(tuple)
INT = st.integers(-(2**63), 2**63 - 1)
REGION = st.builds(p.RegionRef, NAMES, st.integers(0, 2**63 - 1))


@settings(max_examples=200, deadline=None)
@given(
    message=st.one_of(
        st.builds(
            p.Infer,
            INT,
            REFS,
            st.lists(NAMES, max_size=4).map(tuple),
            REGION,
            REGION,
            INT,
            INT,
            INT,
            st.lists(st.builds(p.Piece, INT, INT, INT, INT, INT), max_size=5).map(tuple),
        ),
        st.builds(p.InferDone, INT, REFS, INT, INT, INT, INT, st.none() | INT),
        st.builds(p.InferFailed, INT, NAMES, st.text(max_size=300)),
        st.builds(p.StreamPart, INT, INT, REFS),
        st.builds(p.StreamAck, INT, INT, st.booleans()),
    )
)
def test_any_message_of_the_declared_types_round_trips_in_binary(message: object) -> None:
    payload = w.dumps(message)
    assert payload[0] == KINDS[type(message)]
    assert _exact(w.loads(payload)) == _exact(message)


def test_a_damaged_frame_on_the_socket_is_an_error_not_a_wait() -> None:
    """A whole frame whose payload is damaged: both readers raise at once and do not wait for more bytes."""
    good = encode(p.StreamAck(1, 2))
    damaged = struct.pack("!I", len(good) - 5) + good[4:-1]  # a frame one byte short of a StreamAck
    ours, theirs = socket.socketpair()
    try:
        theirs.sendall(damaged + damaged)
        with pytest.raises(ValueError):
            recv_blocking(ours)
        with pytest.raises(ValueError):
            FrameReader(ours, 5.0).recv()
    finally:
        ours.close()
        theirs.close()
    got: list[object] = []
    proto = FrameProtocol(got.append, lambda exc: None)
    buf = proto.get_buffer(-1)
    buf[: len(damaged)] = damaged
    with pytest.raises(ValueError):
        proto.buffer_updated(len(damaged))
    assert got == []


def test_the_layout_names_every_field_of_each_kind() -> None:
    """A field added to one of these messages must be added to its layout too (this fails until it is)."""
    for message in BINARY.values():
        assert set(vars(w.loads(w.dumps(message)))) == {f.name for f in dataclasses.fields(type(message))}
