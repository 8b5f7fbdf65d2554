"""The shared-memory arena between a front process and the daemon, for large ModelInfer calls.

Through the socketpair, a 600 KB request is copied into the kernel and out again, and so is its reply,
with a wake-up per socket buffer. Instead, the front writes a large request once into a chunk of an arena
the daemon created for it and sends only where it is; the daemon reads the tensor bytes in place, and writes
a large reply into the same chunk when it fits. The front owns the chunks: it frees one only when the
daemon has answered the call, even a cancelled one, so the daemon never touches a chunk that is in use for
another call. Small calls, and large ones when the arena is full, go through the socket as before.

Everything about the arena is here, for both ends: the layout of the references in the frames, the
allocator the front uses, and the reads and writes of a chunk, with their bounds checks.
"""

from __future__ import annotations

import bisect
import struct
from collections.abc import Sequence
from typing import NamedTuple

from mpsd.errors import Internal
from mpsd.ipc.front_wire import Buffer, total_nbytes
from mpsd.ipc.shm import Region

# Requests and replies at least this large go through the arena (smaller ones cost less in a frame).
ARENA_MIN = 32 * 1024
# Room beyond the request in each chunk, so that a reply as large as the request (an identity: the same
# tensor bytes, slightly different message fields) fits too.
REPLY_SLACK = 4096
_ALIGN = 64

# INFER_SHM payload: offset and length of the request in the arena, and the chunk's capacity.
INFER_REF = struct.Struct("!QQQ")
# REPLY_SHM payload: the reply's length, from the start of the call's chunk.
REPLY_REF = struct.Struct("!Q")


def chunk_size(request_bytes: int) -> int:
    """The chunk a request takes: itself, the reply's slack, rounded up to the alignment."""
    return -(-(request_bytes + REPLY_SLACK) // _ALIGN) * _ALIGN


class Chunk(NamedTuple):
    """The part of the arena one call holds until it is answered (a named tuple: one is made for every
    call)."""

    start: int
    capacity: int


# ---- the daemon's end: read a request in place, write a reply into its chunk -----------------------------


def referenced_request(arena: Region | None, ref: Buffer) -> tuple[memoryview, Chunk]:
    """The request an INFER_SHM frame points at, as a view of the arena (no copy), and its call's chunk.

    Internal (the answer to the call) when the reference is malformed or reaches past the arena: the daemon
    never reads, nor later writes, outside it whatever a front sends.
    """
    start, length, capacity = INFER_REF.unpack(ref) if len(ref) == INFER_REF.size else (0, 1, 0)
    return arena_view(arena, start, length, capacity), Chunk(start, capacity)


def arena_view(arena: Region | None, start: int, length: int, capacity: int) -> memoryview:
    """`referenced_request`'s view, from the reference's fields; Internal when they reach past the arena."""
    if arena is None or length > capacity or start + capacity > arena.size:
        raise Internal(f"arena reference out of bounds: {start}+{length} (chunk {capacity})")
    return arena.buf[start : start + length]


def write_reply(arena: Region, chunk: Chunk, parts: Sequence[Buffer]) -> bytes | None:
    """A large reply (`parts` back to back) written into its call's chunk: the REPLY_SHM payload. None
    when it is small or does not fit; it then goes in the frame."""
    total = total_nbytes(parts)
    if total < ARENA_MIN or total > chunk.capacity:
        return None
    buf, pos = arena.buf, chunk.start
    for piece in parts:
        view = memoryview(piece).cast("B")
        buf[pos : pos + view.nbytes] = view
        pos += view.nbytes
    return REPLY_REF.pack(total)


class Allocator:
    """First-fit allocation of [0, size), with freed neighbours merged. One event loop uses it: no locks.

    First fit keeps chunks at low addresses, so the arena's pages that are ever touched stay few.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._starts: list[int] = [0]  # free blocks, sorted by start
        self._sizes: dict[int, int] = {0: size}
        self._taken: dict[int, int] = {}  # start -> size of each chunk handed out

    def allocate(self, size: int) -> int | None:
        """The start of a free chunk of `size` bytes, or None when no free block is that large."""
        if size <= 0:
            raise ValueError(f"chunk size must be positive, got {size}")
        for i, start in enumerate(self._starts):
            free = self._sizes[start]
            if free < size:
                continue
            del self._sizes[start]
            if free == size:
                del self._starts[i]
            else:
                self._starts[i] = start + size
                self._sizes[start + size] = free - size
            self._taken[start] = size
            return start
        return None

    def free(self, start: int) -> None:
        size = self._taken.pop(start)
        i = bisect.bisect_left(self._starts, start)
        if i < len(self._starts) and start + size == self._starts[i]:  # merge with the block after
            size += self._sizes.pop(self._starts.pop(i))
        if i > 0 and self._starts[i - 1] + self._sizes[self._starts[i - 1]] == start:  # and the one before
            self._sizes[self._starts[i - 1]] += size
        else:
            self._starts.insert(i, start)
            self._sizes[start] = size

    @property
    def in_use(self) -> int:
        return sum(self._taken.values())

    def free_blocks(self) -> list[tuple[int, int]]:
        return [(s, self._sizes[s]) for s in self._starts]


# ---- the front's end: a large request into a chunk of its own, the reply out of it ---------------------


def write_request(arena: Region, allocator: Allocator, request: bytes) -> tuple[Chunk, bytes] | None:
    """A large request written into a free chunk: the chunk (the front's until the call is answered) and
    the INFER_SHM payload. None when the request is small or no chunk that large is free: it then goes in
    the frame."""
    size = len(request)
    if size < ARENA_MIN:
        return None
    capacity = chunk_size(size)
    start = allocator.allocate(capacity)
    if start is None:
        return None
    arena.buf[start : start + size] = request
    return Chunk(start, capacity), INFER_REF.pack(start, size, capacity)


def read_reply(arena: Region, chunk: Chunk, ref: bytes | bytearray) -> bytes | None:
    """The reply a REPLY_SHM frame says is at the start of the call's chunk, copied out (the chunk is
    freed next); None when the reference is malformed or reaches past the chunk."""
    length = REPLY_REF.unpack(ref)[0] if len(ref) == REPLY_REF.size else -1
    if not 0 <= length <= chunk.capacity:
        return None
    return bytes(arena.buf[chunk.start : chunk.start + length])
