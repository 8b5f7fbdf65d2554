"""The daemon's private socket directory: where its own gRPC server listens for what fronts forward."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from mpsd.ipc.runtime_dir import runtime_dir

SOCKET_DIR_PREFIX = "mpsd-daemon-"


def _socket_base() -> Path:
    """Where the daemon's private socket directory goes: short enough for a socket path."""
    return runtime_dir()


def make_socket_dir() -> Path:
    """A private (0700) directory for the daemon's internal gRPC socket, named after this process."""
    return Path(tempfile.mkdtemp(prefix=f"{SOCKET_DIR_PREFIX}{os.getpid()}-", dir=_socket_base()))


def remove_stale_socket_dirs() -> list[str]:
    """Remove socket directories of daemons that died without cleaning up (kill -9)."""
    removed = []
    for entry in _socket_base().glob(f"{SOCKET_DIR_PREFIX}*-*"):
        pid = entry.name[len(SOCKET_DIR_PREFIX) :].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid() or not entry.is_dir():
            continue
        if entry.stat().st_uid != os.getuid():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # still running
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry.name)
    return removed
