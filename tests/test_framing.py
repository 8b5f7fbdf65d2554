"""The worker channel's framing: the worker's blocking reader and the daemon's protocol must give back
exactly the messages sent, whatever the chunking, sizes and timing of the bytes."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpsd.ipc import protocol as p
from mpsd.ipc.framing import ConnectionClosed, FrameProtocol, FrameReader, encode, send_blocking

REFS = st.lists(
    st.builds(
        p.TensorRef,
        st.text(max_size=20),
        st.sampled_from(["FP32", "BYTES"]),
        st.lists(st.integers(-1, 2**40), max_size=5).map(tuple),
        st.integers(0, 2**40),
        st.integers(0, 2**40),
    ),
    max_size=3,
).map(tuple)
REGION = st.builds(p.RegionRef, st.text(max_size=30), st.integers(0, 2**40))
IDS = st.integers(0, 2**63 - 1)
MESSAGES = st.lists(
    st.one_of(
        st.builds(p.NeedOutput, IDS, st.integers(0, 2**40)),
        # the per-request kinds travel in their binary layout, the others as pickles
        st.builds(p.Infer, IDS, REFS, st.lists(st.text(max_size=20), max_size=3).map(tuple), REGION, REGION),
        st.builds(p.InferDone, IDS, REFS, IDS, IDS, IDS, IDS, st.none() | IDS),
        st.builds(p.StreamPart, IDS, IDS, REFS),
        st.builds(p.StreamAck, IDS, IDS, st.booleans()),
        st.builds(p.InferFailed, st.integers(0, 1000), st.sampled_from(["INTERNAL"]), st.text(max_size=300)),
        # larger than either end's 64 KiB buffer
        st.builds(p.LoadFailed, st.text(min_size=0, max_size=5).map(lambda s: s + "x" * 70_000)),
        st.just(p.Shutdown()),
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=60, deadline=None)
@given(messages=MESSAGES, cuts=st.lists(st.integers(1, 5000), min_size=1, max_size=40))
def test_the_daemon_protocol_reassembles_messages_from_any_chunking(
    messages: list[object], cuts: list[int]
) -> None:
    got: list[object] = []
    closed: list[Exception | None] = []
    proto = FrameProtocol(got.append, closed.append)
    data = b"".join(encode(m) for m in messages)
    pos, i = 0, 0
    while pos < len(data):
        buf = proto.get_buffer(-1)
        n = min(cuts[i % len(cuts)], len(buf), len(data) - pos)
        assert n > 0, "the protocol always offers room"
        buf[:n] = data[pos : pos + n]
        proto.buffer_updated(n)
        pos += n
        i += 1
    assert got == messages
    assert not closed


def test_the_worker_reader_gets_every_message_with_one_read_for_many() -> None:
    ours, theirs = socket.socketpair()
    try:
        reader = FrameReader(ours, 0.2)
        big = p.LoadFailed("y" * 200_000)
        small = [p.NeedOutput(i, i * 10) if i % 2 else p.StreamAck(i, i * 10) for i in range(50)]
        batch = [*small, big, p.Shutdown()]

        def writer() -> None:  # the large message arrives in pieces, with pauses longer than the timeout
            theirs.sendall(b"".join(encode(m) for m in batch[:50]))
            data = encode(big)
            for k in range(0, len(data), 30_000):
                theirs.sendall(data[k : k + 30_000])
                time.sleep(0.05 if k < 90_000 else 0.3)
            send_blocking(theirs, batch[-1])

        thread = threading.Thread(target=writer)
        thread.start()
        got = [reader.recv_wait() for _ in batch]
        thread.join()
        assert got == batch
    finally:
        ours.close()
        theirs.close()


def test_the_worker_reader_takes_binary_frames_whole_and_larger_than_its_buffer() -> None:
    ours, theirs = socket.socketpair()
    try:
        reader = FrameReader(ours, 1.0)
        ref = p.TensorRef("INPUT0", "FP32", (1, 16), 64, 64)
        infer = p.Infer(1, (ref,), ("OUTPUT0",), p.RegionRef("/a", 4096), p.RegionRef("/b", 4096), 1, 5, 2)
        batch = [infer, p.InferFailed(1, "INTERNAL", "w" * 200_000), infer, p.InferDone(1, (ref,), 1, 2, 3)]
        thread = threading.Thread(target=theirs.sendall, args=(b"".join(encode(m) for m in batch),))
        thread.start()
        got = [reader.recv_wait() for _ in batch]
        thread.join()
        assert got == batch
    finally:
        ours.close()
        theirs.close()


def test_the_worker_reader_polls_without_waiting_and_keeps_what_came_in_part() -> None:
    """`poll` hands over a message only when it is here whole; a partial one, or one larger than the
    buffer, stays for `recv`, in order."""
    ours, theirs = socket.socketpair()
    try:
        reader = FrameReader(ours, 5.0)
        t0 = time.monotonic()
        assert reader.poll() is None  # nothing sent: no wait for the 5 s timeout
        assert time.monotonic() - t0 < 2.5
        first, second = encode(p.StopProfile(1)), encode(p.StopProfile(2))
        theirs.sendall(first + second[:3])
        assert reader.poll() == p.StopProfile(1)
        assert reader.poll() is None  # a partial header
        theirs.sendall(second[3:6])
        assert reader.poll() is None  # a partial body
        large = encode(p.InferFailed(3, "INTERNAL", "w" * 200_000))
        theirs.sendall(second[6:] + large[:100])
        assert reader.poll() == p.StopProfile(2)
        assert reader.poll() is None  # larger than the buffer: left to recv
        theirs.sendall(large[100 : 100 + 2 * FrameReader.BUFFER])  # more of it than the buffer holds
        for _ in range(4):  # the buffer fills up, then stays full: that is no closed peer
            assert reader.poll() is None
        thread = threading.Thread(target=theirs.sendall, args=(large[100 + 2 * FrameReader.BUFFER :],))
        thread.start()
        assert reader.recv_wait() == p.InferFailed(3, "INTERNAL", "w" * 200_000)
        thread.join()
    finally:
        ours.close()
        theirs.close()


def test_the_worker_reader_times_out_and_notices_a_closed_peer() -> None:
    ours, theirs = socket.socketpair()
    reader = FrameReader(ours, 0.1)
    t0 = time.monotonic()
    assert reader.recv() is None, "nothing sent: the timeout passes"
    assert 0.05 <= time.monotonic() - t0 < 5
    theirs.sendall(encode(p.Shutdown())[:3])  # a partial header, then the peer goes
    theirs.close()
    with pytest.raises(ConnectionClosed):
        reader.recv_wait()
    ours.close()


def test_the_daemon_protocol_on_a_real_socket() -> None:
    async def main() -> list[object]:
        ours, theirs = socket.socketpair()
        got: list[object] = []
        done = asyncio.get_running_loop().create_future()
        transport, _ = await asyncio.get_running_loop().create_unix_connection(
            lambda: FrameProtocol(got.append, lambda exc: done.set_result(exc)), sock=ours
        )
        batch = [p.NeedOutput(1, 2), p.LoadFailed("z" * 300_000), p.InferFailed(3, "INTERNAL", "e" * 70_000)]
        await asyncio.to_thread(theirs.sendall, b"".join(encode(m) for m in batch))
        theirs.close()
        assert await asyncio.wait_for(done, 10) is None
        transport.close()
        return got

    want = [p.NeedOutput(1, 2), p.LoadFailed("z" * 300_000), p.InferFailed(3, "INTERNAL", "e" * 70_000)]
    assert asyncio.run(main()) == want
