"""The shared-memory names a daemon has created and not yet unlinked, kept in a file of its own.

macOS has no directory that lists POSIX shared memory (Linux has /dev/shm): a segment is found only by its
name, and one left by a daemon killed with -9 would stay until reboot. So each daemon keeps the names it
holds in `<runtime dir>/mpsd-shm-<pid>`, and the next daemon unlinks those of daemons no longer running.
The file is replaced whole at each change (a new file renamed over it), so a kill leaves the old list or the
new one; no fsync: shared memory itself does not survive a reboot.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

RECORD_PREFIX = "mpsd-shm-"


class NameRecord:
    """This process's record: the names it created, less those it unlinked."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / f"{RECORD_PREFIX}{os.getpid()}"
        self._names: set[str] = set()
        self._lock = threading.Lock()
        self._write()

    def add(self, name: str) -> None:
        """Before the segment is created: a kill in between leaves a name to try, never a segment unnamed."""
        with self._lock:
            self._names.add(name)
            self._write()

    def discard(self, name: str) -> None:
        with self._lock:
            if name in self._names:
                self._names.discard(name)
                self._write()

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._names)

    def remove(self) -> None:
        """The daemon is ending, its names unlinked: the record goes."""
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def _write(self) -> None:
        fd, temporary = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}-")
        try:
            with os.fdopen(fd, "w") as out:
                out.write("".join(f"{name}\n" for name in sorted(self._names)))
            os.replace(temporary, self.path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)
            raise


@dataclass(frozen=True)
class Found:
    """One daemon's record, as a later process reads it."""

    pid: int
    path: Path
    names: list[str]


def records(directory: Path) -> Iterator[Found]:
    """The records in `directory` owned by this user (a file another user planted is not trusted), and the
    temporary files of records being replaced when their daemon died (no names: they are only removed)."""
    for entry in directory.glob(f"{RECORD_PREFIX}*"):
        found = _read(entry, entry.name[len(RECORD_PREFIX) :])
        if found is not None:
            yield found
    for entry in directory.glob(f".{RECORD_PREFIX}*-*"):
        pid = entry.name[len(RECORD_PREFIX) + 1 :].split("-", 1)[0]
        if pid.isdigit() and _owned_file(entry):
            yield Found(int(pid), entry, [])


def _read(entry: Path, pid: str) -> Found | None:
    if not pid.isdigit() or not _owned_file(entry):
        return None
    try:
        text = entry.read_text()
    except OSError:
        return None
    return Found(int(pid), entry, [line for line in text.splitlines() if line])


def _owned_file(entry: Path) -> bool:
    try:
        info = entry.lstat()
    except OSError:
        return False
    return stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid()
