"""The shared-memory arena between a front process and the daemon core, for large ModelInfer calls.

Through the socketpair, a 600 KB request is copied into the kernel and out again, and so is its reply,
with a wake-up per socket buffer. Instead, the front writes a large request once into a chunk of an arena
the core created for it and sends only where it is; the core reads the tensor bytes in place, and writes
a large reply into the same chunk when it fits. The front owns the chunks: it frees one only when the
core has answered the call, even a cancelled one, so the core never touches a chunk that is in use for
another call. Small calls, and large ones when the arena is full, go through the socket as before.
"""

from __future__ import annotations

import bisect
import struct

# Per front, allocated in full when the front starts: a page written where /dev/shm has no room left would
# be a SIGBUS. 16 MiB holds about 25 calls of 600 KB in flight at once; more wait for room or take the
# socket. Where /dev/shm cannot hold it (containers often give 64 MiB), the front runs without an arena.
ARENA_BYTES = 16 * 1024 * 1024
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
