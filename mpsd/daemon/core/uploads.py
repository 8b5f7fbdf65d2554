"""Model files sent with a load request (`file:<path>` parameters), kept in a folder the daemon owns.

Each load's files get a model directory of their own (`<folder>/<one per load>/<model>/`), never inside the
model repository, so a replacement is written beside the files the running version was started from, and
the repository's own files are never touched. Every path is checked before anything is written: relative,
without `.` or `..`, and nothing that exists is opened or followed (files are created, links never
followed). The folder is private (0700), removed at shutdown, and one left by a daemon that died is
removed by the next start.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Collection, Mapping
from pathlib import Path

import structlog

from mpsd.config.repository import CONFIG_FILE, PBTXT_FILE
from mpsd.errors import ConfigError, InvalidArgument

log = structlog.get_logger("mpsd.daemon.core.uploads")

PREFIX = "mpsd-models-"
NAME_MAX = 255  # bytes of one path component (POSIX NAME_MAX on Linux and macOS)
MAX_DEPTH = 16


def path_problem(path: str) -> str | None:
    """Why a `file:` path cannot name a file inside the model directory, or None."""
    if not path:
        return "the path is empty"
    if "\0" in path:
        return "the path holds a NUL character"
    if path.startswith("/"):
        return "an absolute path must stay within model directory"
    parts = path.split("/")
    if any(part in (".", "..") for part in parts):
        return "'.' and '..' are not allowed: the path must stay within model directory"
    if any(not part for part in parts):
        return "the path has an empty component ('//' or a trailing '/')"
    if any(len(part.encode()) > NAME_MAX for part in parts):
        return f"a path component is longer than {NAME_MAX} bytes"
    if len(parts) > MAX_DEPTH:
        return f"the path is more than {MAX_DEPTH} levels deep"
    if len(parts) == 1 and parts[0] in (CONFIG_FILE, PBTXT_FILE):
        return "the model's config is the 'config' parameter, not a file"
    return None


class UploadStore:
    """The daemon's folder of uploaded model directories."""

    def __init__(self, base: Path | None, max_bytes: int, repository: Path) -> None:
        self.max_bytes = max_bytes
        self.base = base if base is not None else Path(tempfile.gettempdir())
        self.repository = repository
        self._root: Path | None = None  # made at the first upload: most daemons never get one
        self._reserved: set[Path] = set()

    @property
    def root(self) -> Path:
        if self._root is None:
            if self.base.resolve().is_relative_to(self.repository.resolve()):
                raise ConfigError(
                    f"the folder for uploaded models ({self.base}) is inside the model repository"
                )
            self._root = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=self.base))
        return self._root

    def check(self, files: Mapping[str, bytes]) -> None:
        """InvalidArgument naming the first `file:` parameter that cannot be written, or the total size."""
        if files and self.max_bytes == 0:
            raise InvalidArgument("loading a model with files is off (max_model_upload_bytes: 0)")
        for key in files:
            problem = path_problem(key.removeprefix("file:"))
            if problem is not None:
                raise InvalidArgument(f"Invalid file parameter '{key}': {problem}")
        total = sum(len(data) for data in files.values())
        if total > self.max_bytes:
            raise InvalidArgument(
                f"the files add up to {total} bytes, more than max_model_upload_bytes ({self.max_bytes})"
            )

    def reserve(self) -> Path:
        """A new empty folder for one load's files, which sweeps leave alone until it is released."""
        holder = Path(tempfile.mkdtemp(dir=self.root))
        self._reserved.add(holder)
        return holder

    def release(self, holder: Path) -> None:
        self._reserved.discard(holder)

    def discard(self, holder: Path) -> None:
        """A refused load's folder: released and removed at once."""
        self.release(holder)
        shutil.rmtree(holder, ignore_errors=True)

    @staticmethod
    def write(holder: Path, model: str, files: Mapping[str, bytes]) -> Path:
        """The model directory `<holder>/<model>` holding `files` (checked with `check` first); blocking
        file I/O, run in a thread."""
        model_dir = holder / model
        model_dir.mkdir(mode=0o700)
        for key, data in sorted(files.items()):
            _write_file(model_dir, key, data)
        return model_dir

    def owns(self, path: Path) -> bool:
        return self._root is not None and path.is_relative_to(self._root)

    def sweep(self, in_use: Collection[Path]) -> None:
        """Remove every uploaded model directory that nothing refers to any more."""
        if self._root is None:
            return
        keep = self._reserved | {p.parent for p in in_use if self.owns(p)}
        for holder in self._root.iterdir():
            if holder not in keep:
                shutil.rmtree(holder, ignore_errors=True)
                log.debug("uploaded model files removed", folder=str(holder))

    def close(self) -> None:
        """Shutdown: the whole folder goes."""
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)

    def remove_stale(self) -> list[str]:
        """Folders left in `base` by daemons that died (kill -9)."""
        removed = []
        for entry in self.base.glob(f"{PREFIX}*-*"):
            pid = entry.name[len(PREFIX) :].split("-", 1)[0]
            if not pid.isdigit() or int(pid) == os.getpid() or entry.is_symlink() or not entry.is_dir():
                continue
            try:
                if entry.stat().st_uid != os.getuid():
                    continue
                os.kill(int(pid), 0)
                continue  # still running
            except ProcessLookupError:
                pass
            except OSError:
                continue
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry.name)
        return removed


def _write_file(model_dir: Path, key: str, data: bytes) -> None:
    """Create the file and the folders to it; nothing that exists is opened or followed (O_EXCL,
    O_NOFOLLOW), so two parameters that collide (`file:1` and `file:1/model.pt`) fail instead of mixing."""
    *folders, name = key.removeprefix("file:").split("/")
    where = model_dir
    try:
        for folder in folders:
            where = where / folder
            with contextlib.suppress(FileExistsError):
                where.mkdir(mode=0o700)
            if where.is_symlink() or not where.is_dir():
                raise InvalidArgument(f"Invalid file parameter '{key}', directory has been created as a file")
        fd = os.open(where / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        raise InvalidArgument(
            f"Invalid file parameter '{key}': a directory of the same name was given"
        ) from None
    except OSError as exc:
        raise InvalidArgument(f"Invalid file parameter '{key}': {exc.strerror}") from None
    with os.fdopen(fd, "wb") as out:
        out.write(data)
