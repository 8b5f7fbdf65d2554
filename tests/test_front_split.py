"""Requests a front cuts apart itself: the key it declares once, the spans it sends with each call, and the
daemon's end of the link that turns them back into the split the daemon would have made.

In-process: the front's `CoreLink` writes its frames into a recorder, and they are fed, in order, to the
daemon's `FrontLink`, whose inference is a function that keeps what it is given. Requests are built with
tritonclient's own classes, so the wire form is the client's.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from hypothesis import given, settings
from hypothesis import strategies as st
from test_front_arena import Recorder, _settle
from test_wire_split import requests
from tritonclient.grpc import service_pb2 as pb

from mpsd.daemon.supervise.fronts.link import FrontLink
from mpsd.errors import Internal
from mpsd.front.headers import MAX_DECLARED, DeclaredHeaders
from mpsd.front.main import CoreLink
from mpsd.ipc.front_arena import ARENA_MIN, INFER_REF, Chunk, referenced_request
from mpsd.ipc.front_wire import Kind
from mpsd.ipc.infer_wire import (
    MAX_KEY_BYTES,
    Spans,
    SplitRequest,
    split_from_spans,
    split_request,
    split_spans,
    unpack_spans,
)
from mpsd.ipc.shm import Region

INTERNAL = grpc.StatusCode.INTERNAL.value[0]


def _same(got: SplitRequest, want: SplitRequest) -> None:
    assert got.key == want.key
    assert [bytes(v) for v in got.raw] == [bytes(v) for v in want.raw]
    assert got.request_id == want.request_id
    assert pb.ModelInferRequest.FromString(bytes(got.rest)) == pb.ModelInferRequest.FromString(
        bytes(want.rest)
    )


@settings(max_examples=300, deadline=None)
@given(requests())
def test_the_split_rebuilt_from_spans_is_the_split_of_the_bytes(request: pb.ModelInferRequest) -> None:
    data = request.SerializeToString(deterministic=True)
    want = split_request(data)
    assert want is not None
    found = split_spans(data)
    if not request.raw_input_contents or len(want.key) > MAX_KEY_BYTES:
        assert found is None  # such a request goes whole
        return
    assert found is not None
    key, spans = found
    got = split_from_spans(data, key, spans)
    assert got is not None
    _same(got, want)


def test_spans_outside_the_request_rebuild_nothing() -> None:
    data = pb.ModelInferRequest(model_name="m", id="7", raw_input_contents=[b"abc"]).SerializeToString()
    found = split_spans(data)
    assert found is not None
    key, spans = found
    assert split_from_spans(data[:-1], key, spans) is None  # the raw entry now reaches past the end
    assert split_from_spans(data, key, type(spans)(len(data), len(data) + 1, spans.raw)) is None


def _request(model: str, request_id: str, tensor: bytes) -> bytes:
    request = pb.ModelInferRequest(model_name=model, id=request_id, raw_input_contents=[tensor])
    request.inputs.add(name="x", datatype="UINT8", shape=[len(tensor)])
    return bytes(request.SerializeToString())


def _links(region: Region | None = None) -> tuple[CoreLink, Recorder, FrontLink, Recorder, list[Any]]:
    """A front and the daemon's end of its link, with what the daemon's inference was given."""
    seen: list[Any] = []

    async def infer(data: Any, deadline: float | None, traceparent: str | None) -> list[bytes]:
        seen.append(data)
        return [b"ok"]

    front = CoreLink()
    if region is not None:
        front.attach_arena(region.name, region.size)
    to_daemon = Recorder()
    front.writer.transport = to_daemon  # type: ignore[assignment]
    daemon = FrontLink(0, infer, lambda _: None, arena=region)
    to_front = Recorder()
    daemon.attach(to_front)  # type: ignore[arg-type]
    return front, to_daemon, daemon, to_front, seen


def _deliver(frames: list[tuple[int, int, float, bytes]], daemon: FrontLink) -> None:
    for kind, call_id, number, payload in frames:
        daemon._on_frame(kind, call_id, number, payload)


def test_a_front_declares_each_key_once_and_the_daemon_gets_the_split_it_would_make() -> None:
    async def run() -> None:
        region = Region.create(1 << 20)
        try:
            front, to_daemon, daemon, to_front, seen = _links(region)
            sent = [
                _request("a", "1", b"\x01" * 8),  # small: in the frame
                _request("a", "2", b"\x02" * 8),  # the same key: no second declaration
                _request("b", "", b"\x03" * ARENA_MIN),  # large: in the arena, another key, no id
                _request("a", "3", b"\x04" * 8),
            ]
            for call_id, data in enumerate(sent, 1):
                front.send(front._infer_frame(call_id, -1.0, data))
            await _settle()
            frames = to_daemon.frames()
            kinds = [(kind, call_id) for kind, call_id, _, _ in frames]
            assert kinds == [
                (Kind.HEADER, 1),
                (Kind.INFER_SPLIT, 1),
                (Kind.INFER_SPLIT, 2),
                (Kind.HEADER, 2),
                (Kind.INFER_SPLIT_SHM, 3),
                (Kind.INFER_SPLIT, 4),
            ]
            _deliver(frames, daemon)
            await _settle()
            assert len(seen) == 4 and all(isinstance(s, SplitRequest) for s in seen)
            for got, data in zip(seen, sent, strict=True):
                want = split_request(data)
                assert want is not None
                _same(got, want)
            # The daemon finds each key as the one bytes object it keeps, whose hash is computed once.
            assert seen[0].key is seen[1].key is seen[3].key
            assert daemon.counts.split == 4 and daemon.counts.arena_requests == 1
            assert [f[:2] for f in to_front.frames()] == [(Kind.REPLY, i) for i in (1, 2, 3, 4)]
        finally:
            region.unlink()

    asyncio.run(run())


def test_a_request_with_nothing_to_split_goes_whole() -> None:
    async def run() -> None:
        front, to_daemon, daemon, _, seen = _links()
        typed = pb.ModelInferRequest(model_name="a")
        typed.inputs.add(name="x", datatype="INT32", shape=[1]).contents.int_contents.append(5)
        for call_id, data in enumerate((typed.SerializeToString(), b"\xff not protobuf"), 1):
            front.send(front._infer_frame(call_id, -1.0, data))
        await _settle()
        frames = to_daemon.frames()
        assert [f[:2] for f in frames] == [(Kind.INFER, 1), (Kind.INFER, 2)]
        _deliver(frames, daemon)
        await _settle()
        assert [bytes(s) for s in seen] == [typed.SerializeToString(), b"\xff not protobuf"]
        assert daemon.counts.split == 0

    asyncio.run(run())


def test_the_front_starts_its_keys_again_past_the_limit_and_tells_the_daemon_first() -> None:
    sent: list[tuple[Any, ...]] = []
    headers = DeclaredHeaders(sent.append)
    for n in range(MAX_DECLARED + 1):
        assert headers.spans(_request(f"m{n}", "", b"x")) is not None
    kinds = [parts[0][0] for parts in sent]  # each frame's header starts with its kind
    assert kinds == [Kind.HEADER] * MAX_DECLARED + [Kind.FORGET_HEADERS, Kind.HEADER]
    assert len(headers) == 1


def test_calls_that_name_what_the_daemon_does_not_have_are_answered_with_errors() -> None:
    async def run() -> None:
        front, to_daemon, daemon, to_front, seen = _links()
        front.send(front._infer_frame(1, -1.0, _request("a", "1", b"\x01" * 8)))
        await _settle()
        declared, call = to_daemon.frames()
        assert declared[0] == Kind.HEADER and call[0] == Kind.INFER_SPLIT
        daemon._on_frame(*declared)
        daemon._on_frame(Kind.FORGET_HEADERS, 0, 0.0, b"")
        daemon._on_frame(*call)  # its key is forgotten
        daemon._on_frame(*declared)
        daemon._on_frame(Kind.INFER_SPLIT, 2, -1.0, call[3][:5])  # the spans cut short
        spans, request = call[3][: len(call[3]) - len(_request("a", "1", b"\x01" * 8))], b"\x00"
        daemon._on_frame(Kind.INFER_SPLIT, 3, -1.0, spans + request)  # spans past the request
        await _settle()
        answers = [(kind, call_id, int(code), text) for kind, call_id, code, text in to_front.frames()]
        assert [a[:3] for a in answers] == [(Kind.REPLY, i, INTERNAL) for i in (1, 2, 3)]
        assert b"not declared" in answers[0][3] and b"malformed request spans" in answers[1][3]
        assert b"reach outside the request" in answers[2][3]
        assert seen == []

    asyncio.run(run())


def _stepwise(link: FrontLink, payload: bytes) -> tuple[SplitRequest, Chunk | None]:
    """An INFER_SPLIT_SHM payload read step by step, as any other split call is: the spans, then the arena
    reference, then the split rebuilt from them."""
    found = unpack_spans(payload)
    if found is None:
        raise Internal("malformed request spans")
    header_id, spans, end = found
    data, chunk = referenced_request(link.arena, memoryview(payload)[end:])
    key = link.headers.get(header_id)
    if key is None:
        raise Internal("not declared")
    split = split_from_spans(data, key, spans)
    if split is None:
        raise Internal("reach outside")
    return split, chunk


def _outcome(read: Any) -> Any:
    try:
        split, chunk = read()
    except Internal:
        return "Internal"
    return split.key, [bytes(r) for r in split.raw], split.request_id, bytes(split.rest), chunk


ARENA = 1 << 16
near = st.one_of(st.integers(-2, 70), st.integers(ARENA - 70, ARENA + 2), st.integers(0, ARENA))


@settings(max_examples=400, deadline=None)
@given(
    header_id=st.integers(0, 3),
    raw=st.tuples(near, near),
    request_id=st.tuples(st.integers(-1, 70), st.integers(-1, 70)),
    ref=st.tuples(near, near, near),
    entries=st.integers(0, 2),
)
def test_a_call_of_one_raw_entry_in_the_arena_is_read_as_the_steps_read_it(
    header_id: int,
    raw: tuple[int, int],
    request_id: tuple[int, int],
    ref: tuple[int, int, int],
    entries: int,
) -> None:
    """Such calls (most calls) are read in one unpack: whatever the fields, the split and chunk it gives, or
    its Internal error, are those of the steps every other split call takes."""
    region = Region.create(ARENA)
    try:
        region.buf[:ARENA] = bytes(range(256)) * (ARENA // 256)
        loop = asyncio.new_event_loop()
        link = FrontLink(0, None, lambda _: None, ready=loop.create_future(), arena=region)  # type: ignore[arg-type]
        loop.close()
        link.headers = {1: b"key one", 2: b"key two"}
        spans = Spans(*request_id, tuple(max(0, n) for n in raw)).pack(header_id)
        if entries != 1:  # the count says otherwise: the one-unpack read must not trust the layout
            spans = spans[:4] + entries.to_bytes(2, "big") + spans[6:]
        payload = spans + INFER_REF.pack(*(max(0, n) for n in ref))
        assert len(payload) == 62
        fast = _outcome(lambda: link._request(Kind.INFER_SPLIT_SHM, payload))
        assert fast == _outcome(lambda: _stepwise(link, payload))
    finally:
        region.unlink()
