"""Clients' POSIX shared-memory objects as tests name, find and remove them on any system.

By name, through shm_open and shm_unlink, never through /dev/shm: macOS has no such folder, so a test that
looked there would find nothing and clean up nothing (the objects would stay until reboot). Names stay
within macOS's 31 characters. Whether an object may be sized again is darwin's fact in `mpsd.osfacts`.
"""

from __future__ import annotations

import _posixshmem
import contextlib
import os

from mpsd import osfacts


def checked(key: str) -> str:
    """`key`, once known to fit every system's limit on a name (macOS's PSHMNAMLEN, the slash included)."""
    limit = osfacts.DARWIN.shm_name_max
    assert len(key) <= limit, f"shared-memory name {key!r} is {len(key)} characters; macOS takes {limit}"
    return key


def exists(key: str) -> bool:
    """Whether an object named `key` exists (opened by name, as every system allows)."""
    try:
        fd = _posixshmem.shm_open(key, os.O_RDONLY, 0)
    except FileNotFoundError:
        return False
    os.close(fd)
    return True


def unlink(key: str) -> None:
    """Remove the object named `key`, if there is one."""
    with contextlib.suppress(FileNotFoundError):
        _posixshmem.shm_unlink(key)


def resize_refusal() -> str | None:
    """Why an object cannot be sized again where the facts in force say so (a skip reason), else None."""
    if osfacts.current().shm_resizable:
        return None
    return (
        f"{osfacts.current().name} sizes a shared-memory object once (XNU allows one ftruncate per object): "
        "its owner cannot shrink it under the daemon"
    )
