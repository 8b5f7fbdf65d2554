"""The shared-memory arena between a front and the daemon: the allocator, which calls use it, and
the rules that keep a chunk safe to reuse (an answer to every call, bounds, and a batch that reads nothing
of a request whose caller is gone).

The link tests run the real CoreLink and FrontLink on a real arena; only the socket under them is a
stand-in that records the frames written, so each rule can be checked frame by frame.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from typing import Any

import grpc
import pytest
import structlog.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from mpsd import osfacts
from mpsd.daemon.dataplane.marshal import assemble
from mpsd.daemon.dataplane.request import InferRequest, InputTensor
from mpsd.daemon.supervise.fronts.link import FrontLink
from mpsd.front.main import CoreLink
from mpsd.ipc.front_arena import ARENA_MIN, INFER_REF, REPLY_REF, REPLY_SLACK, Allocator, chunk_size
from mpsd.ipc.front_wire import HEADER, Kind
from mpsd.ipc.protocol import TensorRef
from mpsd.ipc.shm import Region


def test_first_fit_takes_the_lowest_free_address_and_merges_what_is_freed() -> None:
    alloc = Allocator(1000)
    a, b, c = alloc.allocate(100), alloc.allocate(200), alloc.allocate(300)
    assert (a, b, c) == (0, 100, 300)
    assert alloc.allocate(401) is None  # 400 left at the end
    alloc.free(100)
    assert alloc.allocate(150) == 100  # the hole, not the end
    alloc.free(0)
    alloc.free(100)
    alloc.free(300)
    assert alloc.free_blocks() == [(0, 1000)]
    assert alloc.in_use == 0
    with pytest.raises(ValueError, match="must be positive"):
        alloc.allocate(0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 300)), max_size=60))
def test_chunks_never_overlap_and_everything_freed_is_one_block_again(ops: list[tuple[bool, int]]) -> None:
    size = 2000
    alloc = Allocator(size)
    held: dict[int, int] = {}
    for take, n in ops:
        if take or not held:
            start = alloc.allocate(n)
            if start is None:
                assert all(free < n for _, free in alloc.free_blocks())
                continue
            assert start >= 0 and start + n <= size
            assert all(start + n <= s or s + m <= start for s, m in held.items())
            held[start] = n
        else:
            start = sorted(held)[n % len(held)]
            del held[start]
            alloc.free(start)
        assert alloc.in_use == sum(held.values())
        blocks = alloc.free_blocks()
        assert sum(m for _, m in blocks) == size - alloc.in_use
        assert all(s1 + m1 < s2 for (s1, m1), (s2, _) in itertools.pairwise(blocks))  # merged
    for start in list(held):
        alloc.free(start)
    assert alloc.free_blocks() == [(0, size)]


def test_a_chunk_holds_the_request_and_a_reply_a_little_larger() -> None:
    for n in (ARENA_MIN, ARENA_MIN + 1, 600_000):
        assert chunk_size(n) >= n + REPLY_SLACK
        assert chunk_size(n) % 64 == 0


class Recorder:
    """Stands in for the socket under a link: keeps each frame written, as (kind, call id, number,
    payload)."""

    def __init__(self) -> None:
        self.data = bytearray()

    def writelines(self, parts: Sequence[Any]) -> None:
        for part in parts:
            self.data += bytes(part)

    def is_closing(self) -> bool:
        return False

    def frames(self) -> list[tuple[int, int, float, bytes]]:
        out, pos = [], 0
        while pos < len(self.data):
            kind, call_id, number, length = HEADER.unpack_from(self.data, pos)
            pos += HEADER.size
            out.append((kind, call_id, number, bytes(self.data[pos : pos + length])))
            pos += length
        return out


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_the_front_puts_large_requests_in_the_arena_until_it_is_full() -> None:
    async def run() -> None:
        region = Region.create(256 * 1024)
        try:
            link = CoreLink()
            link.attach_arena(region.name, region.size)
            wire = Recorder()
            link.writer.transport = wire  # type: ignore[assignment]
            big = bytes(range(256)) * 400  # 100 KiB
            for call_id in (1, 2, 3):
                link.send(link._infer_frame(call_id, -1.0, big))
            link.send(link._infer_frame(4, -1.0, b"small"))
            await _settle()
            kinds = [(f[0], f[1]) for f in wire.frames()]
            # Two chunks fit in 256 KiB; the third large call and the small one travel in their frames.
            assert kinds == [(Kind.INFER_SHM, 1), (Kind.INFER_SHM, 2), (Kind.INFER, 3), (Kind.INFER, 4)]
            start, length, capacity = INFER_REF.unpack(wire.frames()[1][3])
            assert length == len(big) and capacity == chunk_size(len(big))
            assert bytes(region.buf[start : start + length]) == big
            # The daemon's answer frees the chunk, whatever it says: a reply in the chunk is read from there,
            # and the answer to a call the client cancelled (its waiter gone) frees its chunk as well.
            waiter = asyncio.get_running_loop().create_future()
            link._pending[2] = waiter
            region.buf[start : start + 5] = b"reply"
            link._on_frame(Kind.REPLY_SHM, 2, 0, REPLY_REF.pack(5))
            assert waiter.result() == (0, b"reply")
            link._on_frame(Kind.REPLY, 1, grpc.StatusCode.CANCELLED.value[0], b"cancelled")
            for call_id in (5, 6):  # both chunks are free again
                link.send(link._infer_frame(call_id, -1.0, big))
            await _settle()
            assert [f[:2] for f in wire.frames()[-2:]] == [(Kind.INFER_SHM, 5), (Kind.INFER_SHM, 6)]
        finally:
            region.unlink()

    asyncio.run(run())


def _daemon_link(infer: Any, region: Region) -> tuple[FrontLink, Recorder]:
    link = FrontLink(0, infer, lambda _: None, arena=region)
    wire = Recorder()
    link.attach(wire)  # type: ignore[arg-type]
    return link, wire


def test_the_core_reads_the_request_in_place_and_answers_into_its_chunk() -> None:
    async def run() -> None:
        region = Region.create(1 << 20)
        seen: list[bytes] = []

        async def infer(data: Any, deadline: float | None, traceparent: str | None) -> list[bytes]:
            seen.append(bytes(data))
            return [b"head", bytes(ARENA_MIN)]

        try:
            link, wire = _daemon_link(infer, region)
            region.buf[4096 : 4096 + 6] = b"tensor"
            link._on_frame(Kind.INFER_SHM, 7, -1.0, INFER_REF.pack(4096, 6, ARENA_MIN + 4096))
            await _settle()
            assert seen == [b"tensor"]
            ((kind, call_id, _, payload),) = wire.frames()
            assert (kind, call_id) == (Kind.REPLY_SHM, 7)
            (length,) = REPLY_REF.unpack(payload)
            assert length == 4 + ARENA_MIN and bytes(region.buf[4096 : 4096 + 4]) == b"head"
            assert (link.counts.arena_requests, link.counts.arena_replies) == (1, 1)
            # A reply larger than the chunk goes in the frame.
            link._on_frame(Kind.INFER_SHM, 8, -1.0, INFER_REF.pack(0, 6, 4096 + 64))
            await _settle()
            assert wire.frames()[-1][:2] == (Kind.REPLY, 8)
            assert wire.frames()[-1][3] == b"head" + bytes(ARENA_MIN)
            # A reference outside the arena is answered with an error, not read.
            link._on_frame(Kind.INFER_SHM, 9, -1.0, INFER_REF.pack(region.size - 10, 6, 4096))
            await _settle()
            kind, call_id, number, message = wire.frames()[-1]
            assert (kind, call_id, int(number)) == (Kind.REPLY, 9, grpc.StatusCode.INTERNAL.value[0])
            assert b"out of bounds" in message
            assert len(seen) == 2
        finally:
            region.unlink()

    asyncio.run(run())


def test_a_cancelled_call_is_answered_so_that_its_chunk_is_freed() -> None:
    async def run() -> None:
        region = Region.create(1 << 20)
        release = asyncio.Event()
        finished: list[int] = []

        async def infer(data: Any, deadline: float | None, traceparent: str | None) -> list[bytes]:
            await release.wait()
            finished.append(len(data))
            return [b"ok"]

        try:
            link, wire = _daemon_link(infer, region)
            link._on_frame(Kind.INFER_SHM, 1, -1.0, INFER_REF.pack(0, 100, 4096))
            link._on_frame(Kind.INFER, 2, -1.0, b"x" * 50)
            link._on_frame(Kind.INFER, 3, -1.0, b"y" * 50)
            await _settle()
            link._on_frame(Kind.CANCEL, 1, 0, b"")
            link._on_frame(Kind.CANCEL, 2, 0, b"")
            await _settle()
            cancelled = grpc.StatusCode.CANCELLED.value[0]
            assert sorted((f[0], f[1], int(f[2])) for f in wire.frames()) == [
                (Kind.REPLY, 1, cancelled),
                (Kind.REPLY, 2, cancelled),
            ]
            release.set()
            await _settle()
            assert finished == [50]  # only call 3 ran
            assert wire.frames()[-1][:3] == (Kind.REPLY, 3, 0)
            assert link.calls == {}
        finally:
            region.unlink()

    asyncio.run(run())


def test_a_batch_copies_nothing_from_a_request_whose_caller_is_gone() -> None:
    """Its bytes may be in an arena chunk the front has reused since: its rows are left as they were."""

    async def run() -> None:
        loop = asyncio.get_running_loop()
        live, gone = loop.create_future(), loop.create_future()
        gone.cancel()

        def request(data: bytes | memoryview) -> InferRequest:
            tensor = InputTensor("x", "UINT8", (len(data),), data)
            return InferRequest("m", "1", "", (tensor,), ("y",), len(data))

        requests = [request(bytes([1, 1])), request(memoryview(bytes([2, 2]))), request(bytes([3]))]
        buf = memoryview(bytearray(8))
        refs = [TensorRef("x", "UINT8", (5,), 1, 5)]
        assemble(buf, refs, requests, [live, gone, live])
        assert bytes(buf) == bytes([0, 1, 1, 0, 0, 3, 0, 0])
        assemble(buf, refs, requests, [])  # nobody to ask: everything is copied
        assert bytes(buf) == bytes([0, 1, 1, 2, 2, 3, 0, 0])

    asyncio.run(run())


def test_malformed_arena_frames_are_answered_with_errors_on_both_ends() -> None:
    async def run() -> None:
        region = Region.create(1 << 20)

        async def infer(data: Any, deadline: float | None, traceparent: str | None) -> list[bytes]:
            raise AssertionError("a malformed reference must not reach the model")

        try:
            link, wire = _daemon_link(infer, region)
            link._on_frame(Kind.INFER_SHM, 1, -1.0, b"short")
            await _settle()
            ((kind, call_id, number, message),) = wire.frames()
            assert (kind, call_id, int(number)) == (Kind.REPLY, 1, grpc.StatusCode.INTERNAL.value[0])
            assert b"out of bounds" in message

            front = CoreLink()
            front.attach_arena(region.name, region.size)
            front.writer.transport = Recorder()  # type: ignore[assignment]
            front.send(front._infer_frame(2, -1.0, bytes(ARENA_MIN)))
            waiter = asyncio.get_running_loop().create_future()
            front._pending[2] = waiter
            front._on_frame(Kind.REPLY_SHM, 2, 0, REPLY_REF.pack(chunk_size(ARENA_MIN) + 1))  # past the chunk
            code, text = waiter.result()
            assert code == grpc.StatusCode.INTERNAL.value[0] and b"outside the call's chunk" in text
            assert front._allocator is not None and front._allocator.in_use == 0  # freed all the same
        finally:
            region.unlink()

    asyncio.run(run())


def test_arenas_are_allocated_up_front_and_fronts_go_without_when_dev_shm_is_full(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import os

    from mpsd.config.daemon_config import DaemonConfig
    from mpsd.daemon.supervise.fronts import pool as fronts

    region = Region.create(1 << 20, reserve=True)
    try:
        shm_dir = osfacts.current().shm_dir  # macOS has neither the folder nor posix_fallocate
        if hasattr(os, "posix_fallocate") and shm_dir is not None:
            blocks = os.stat(f"{shm_dir}{region.name}").st_blocks
            assert blocks * 512 >= region.size  # the pages are taken, not promised
    finally:
        region.unlink()

    def full(size: int, reserve: bool = False, keep_fd: bool = False) -> Region:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fronts.Region, "create", full)
    pool = fronts.FrontPool(1, DaemonConfig(), "unix:nowhere", lambda data, deadline: None)  # type: ignore[arg-type,return-value]
    with structlog.testing.capture_logs() as logged:
        assert pool._arena() is None
        assert pool._arena() is None
    warned = [e for e in logged if e["event"].startswith("no shared memory for the front arenas")]
    assert len(warned) == 1 and warned[0]["reason"] == "No space left on device"


def test_an_arena_takes_half_as_much_where_dev_shm_has_no_room_for_the_configured_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mpsd.config.daemon_config import DaemonConfig
    from mpsd.daemon.supervise.fronts import pool as fronts

    created = Region.create
    asked: list[int] = []

    def room_for_16_mib(size: int, reserve: bool = False, keep_fd: bool = False) -> Region:
        asked.append(size)
        if size > 16 << 20:
            raise OSError(28, "No space left on device")
        return created(size, reserve=reserve, keep_fd=keep_fd)

    monkeypatch.setattr(fronts.Region, "create", room_for_16_mib)
    pool = fronts.FrontPool(1, DaemonConfig(), "unix:nowhere", lambda data, deadline: None)  # type: ignore[arg-type,return-value]
    with structlog.testing.capture_logs() as logged:
        arena = pool._arena()
    assert arena is not None
    try:
        assert (arena.size, asked) == (16 << 20, [64 << 20, 32 << 20, 16 << 20])
    finally:
        arena.unlink()
        arena.close()
    assert not [e for e in logged if e["event"].startswith("no shared memory")]
    off = fronts.FrontPool(1, DaemonConfig(front_arena_bytes=0), "unix:nowhere", lambda data, deadline: None)  # type: ignore[arg-type,return-value]
    assert off._arena() is None
