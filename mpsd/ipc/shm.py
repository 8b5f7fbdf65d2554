"""POSIX shared-memory regions for tensor bytes.

The daemon creates every region and unlinks its name as soon as the worker has mapped it. A name still
linked when the daemon is killed is unlinked by the next daemon: on Linux it lists /dev/shm, and on macOS,
which lists no shared memory anywhere, it reads the names the dead daemon recorded (`shm_record`).
`multiprocessing.shared_memory` is not used because attaching from a worker registers the segment with a
resource tracker that unlinks it when that worker exits.
"""

from __future__ import annotations

import _posixshmem
import contextlib
import itertools
import mmap
import os
import re
import secrets
import threading
from pathlib import Path

from mpsd import osfacts
from mpsd.ipc.runtime_dir import runtime_dir
from mpsd.ipc.shm_record import NameRecord, records

PREFIX = "mpsd-"
# Random per process: a daemon that gets the pid of one killed with -9 never meets its names (O_EXCL).
TAG = secrets.token_hex(3)
_counter = itertools.count()
# `mpsd-<pid>-<tag>-<n>`, and `mpsd-<pid>-<n>` of daemons from before the tag.
_NAME_RE = re.compile(r"^mpsd-(\d+)-[0-9a-f]+(?:-[0-9a-f]+)?$")
_record: NameRecord | None = None  # the daemon's, from `keep_record`
_mapped = 0  # bytes of shared memory this process has mapped now
_mapped_lock = threading.Lock()


def format_name(pid: int, tag: str, n: int) -> str:
    """`/mpsd-<pid>-<tag>-<n in hex>`: with a 7-digit pid (Linux's largest), a 6-character tag and n below
    16**10, 31 characters, macOS's limit (the slash included); Linux allows 255."""
    return f"/{PREFIX}{pid}-{tag}-{n:x}"


def new_name() -> str:
    """A name of this process, tagged with its pid for stale-segment cleanup."""
    return format_name(os.getpid(), TAG, next(_counter))


def mapped_bytes() -> int:
    """Shared memory this process has mapped now (what its RSS may hold of the daemon's regions and the
    fronts' arenas, which are not its own memory)."""
    return _mapped


def _count_mapped(nbytes: int) -> None:
    global _mapped
    with _mapped_lock:
        _mapped += nbytes


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
        if create and _record is not None:
            _record.add(name)
        try:
            fd = _posixshmem.shm_open(name, flags, 0o600)
        except BaseException:
            if create and _record is not None:
                _record.discard(name)
            raise
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
                if _record is not None:
                    _record.discard(name)
            raise
        _count_mapped(size)
        self._counted = True
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
        _count_mapped(size)
        region._counted = True
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
            if _record is not None:
                _record.discard(self.name)

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
        if self._counted:
            self._counted = False
            _count_mapped(-self.size)
        self.drop_fd()
        return True


def keep_record(directory: Path | None = None) -> Path:
    """From now on, record the names this process creates, in `directory` (the runtime dir): the daemon
    calls this at start, after `cleanup_stale`. Returns the record's path."""
    global _record
    _record = NameRecord(directory or runtime_dir())
    return _record.path


def cleanup_stale(directory: Path | None = None) -> list[str]:
    """Unlink segments left by mpsd daemons that no longer run: the names their records hold, and on Linux
    also those listed under /dev/shm. A record under this process's own pid, not kept by it, was left by
    an earlier process of that pid."""
    removed: list[str] = []
    for found in records(directory or runtime_dir()):
        if _record is not None and found.path == _record.path:
            continue
        if found.pid != os.getpid() and _pid_alive(found.pid):
            continue
        for name in (n.lstrip("/") for n in found.names):
            if _NAME_RE.match(name) and _unlink(name):
                removed.append(name)
        with contextlib.suppress(FileNotFoundError):
            found.path.unlink()
    for name in _listed():
        m = _NAME_RE.match(name)
        if not m or int(m.group(1)) == os.getpid() or _pid_alive(int(m.group(1))):
            continue
        if _unlink(name):
            removed.append(name)
    return sorted(set(removed))


def cleanup_own() -> list[str]:
    """At exit: unlink any segment of this process that is still named (normally none are), and drop the
    record."""
    global _record
    removed: list[str] = []
    own = [n.lstrip("/") for n in _record.names()] if _record is not None else []
    for name in sorted(set(own + _listed())):
        m = _NAME_RE.match(name)
        if m and int(m.group(1)) == os.getpid() and _unlink(name):
            removed.append(name)
    if _record is not None:
        _record.remove()
        _record = None
    return removed


def _unlink(name: str) -> bool:
    try:
        _posixshmem.shm_unlink("/" + name.lstrip("/"))
    except OSError:
        return False
    return True


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _listed() -> list[str]:
    """mpsd's names in the system's listing of shared memory (/dev/shm); empty where there is none."""
    where = osfacts.current().shm_dir
    if where is None or not os.path.isdir(where):
        return []
    return sorted(e.name for e in Path(where).iterdir() if e.name.startswith(PREFIX))


def exists(name: str) -> bool:
    """Whether a segment of that name exists, asked of the system itself (shm_open)."""
    try:
        fd = _posixshmem.shm_open("/" + name.lstrip("/"), os.O_RDONLY, 0)
    except FileNotFoundError:
        return False
    os.close(fd)
    return True


def list_segments(directory: Path | None = None) -> list[str]:
    """Names of mpsd segments present now: /dev/shm's listing on Linux; where the system lists none
    (macOS), the recorded names of every daemon (in `directory`, the runtime dir) that still exist."""
    if osfacts.current().shm_dir is not None:
        return _listed()
    names = {n.lstrip("/") for found in records(directory or runtime_dir()) for n in found.names}
    return sorted(n for n in names if n.startswith(PREFIX) and exists(n))
