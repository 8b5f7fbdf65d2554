"""POSIX shared-memory regions for tensor bytes.

The daemon creates every region and unlinks its name as soon as the worker has mapped it, so no segment
survives the daemon, even after kill -9. `multiprocessing.shared_memory` is not used because attaching from
a worker registers the segment with a resource tracker that unlinks it when that worker exits.
"""

from __future__ import annotations

import _posixshmem
import contextlib
import itertools
import mmap
import os
import re
from pathlib import Path

PREFIX = "mpsd-"
_counter = itertools.count()
_NAME_RE = re.compile(r"^mpsd-(\d+)-\d+$")
_DEV_SHM = Path("/dev/shm")


def new_name() -> str:
    """Short enough for macOS (31 characters) and tagged with our pid for stale-segment cleanup."""
    return f"/{PREFIX}{os.getpid()}-{next(_counter)}"


def page_round(n: int) -> int:
    page = mmap.PAGESIZE
    return max(page, (n + page - 1) // page * page)


class Region:
    """A mapped shared-memory segment."""

    def __init__(
        self, name: str, size: int, *, create: bool, reserve: bool = False, keep_fd: bool = False
    ) -> None:
        self.name = name
        self.size = size
        self.fd: int | None = None  # kept open with `keep_fd`: another process can be given it
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = _posixshmem.shm_open(name, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            if reserve and hasattr(os, "posix_fallocate"):
                # Take the pages now: writing to a page the shared-memory filesystem has no room for is a
                # SIGBUS, which no caller can catch; this fails with ENOSPC instead.
                os.posix_fallocate(fd, 0, size)
            self._mmap = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            if create:
                _posixshmem.shm_unlink(name)
            raise
        if keep_fd:
            self.fd = fd
        else:
            os.close(fd)
        self.buf = memoryview(self._mmap)
        self._linked = create

    @classmethod
    def create(cls, size: int, reserve: bool = False, keep_fd: bool = False) -> Region:
        """A new named region; `reserve` allocates all its memory now (Linux), failing with OSError when
        the shared-memory filesystem (/dev/shm) has no room for it; `keep_fd` keeps its descriptor (`fd`)
        open until it is closed, for processes started later (its name is gone by then)."""
        return cls(new_name(), page_round(size), create=True, reserve=reserve, keep_fd=keep_fd)

    @classmethod
    def from_fd(cls, fd: int, size: int) -> Region:
        """Map a region whose descriptor this process inherited (the descriptor is closed: the mapping
        keeps the memory)."""
        region = cls.__new__(cls)
        region.name, region.size, region.fd, region._linked = "", size, None, False
        try:
            region._mmap = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        region.buf = memoryview(region._mmap)
        return region

    @classmethod
    def attach(cls, name: str, size: int) -> Region:
        return cls(name, size, create=False)

    def unlink(self) -> None:
        """Remove the name; mappings stay valid until closed."""
        if self._linked:
            self._linked = False
            with contextlib.suppress(FileNotFoundError):
                _posixshmem.shm_unlink(self.name)

    def drop_fd(self) -> None:
        """Close the kept descriptor now (the mapping stays)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def close(self) -> bool:
        """Unmap; returns False while tensors still borrow the memory (try again later)."""
        try:
            self.buf.release()
            self._mmap.close()
        except BufferError:
            self.buf = memoryview(self._mmap)  # the mapping stays; so must a usable view of it
            return False
        self.drop_fd()
        return True


def cleanup_stale() -> list[str]:
    """Unlink segments left by mpsd daemons that no longer run (Linux lists them under /dev/shm)."""
    removed: list[str] = []
    if not _DEV_SHM.is_dir():
        return removed
    for entry in _DEV_SHM.iterdir():
        m = _NAME_RE.match(entry.name)
        if not m or int(m.group(1)) == os.getpid():
            continue
        if _pid_alive(int(m.group(1))):
            continue
        try:
            _posixshmem.shm_unlink("/" + entry.name)
            removed.append(entry.name)
        except OSError:
            pass
    return removed


def cleanup_own() -> list[str]:
    """At exit: unlink any segment of this process that is still named (normally none are)."""
    removed: list[str] = []
    for name in list_segments():
        m = _NAME_RE.match(name)
        if m and int(m.group(1)) == os.getpid():
            with contextlib.suppress(OSError):
                _posixshmem.shm_unlink("/" + name)
                removed.append(name)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_segments() -> list[str]:
    """Names of mpsd segments currently present (Linux only; empty elsewhere)."""
    if not _DEV_SHM.is_dir():
        return []
    return sorted(e.name for e in _DEV_SHM.iterdir() if e.name.startswith(PREFIX))
