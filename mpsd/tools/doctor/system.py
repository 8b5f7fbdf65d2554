"""What the operating system must allow: shared memory with mpsd's names, the daemon's socket paths under
this TMPDIR, and enough open files. Limits come from `osfacts.current()`, so darwin's can be checked here."""

from __future__ import annotations

import _posixshmem
import os
import resource
import shutil
import socket
from pathlib import Path

from mpsd import osfacts
from mpsd.tools.doctor.report import Check, Setup, failed, passed

WANTED_FILES = 10240
PROBE = b"mpsd doctor"


def shared_memory() -> Check:
    """Create a region as the daemon does, map it a second time by name (as a worker does), compare, unlink,
    and check the name is gone."""
    from mpsd.ipc.shm import Region

    facts = osfacts.current()
    region = Region.create(len(PROBE))
    name = region.name
    try:
        region.buf[: len(PROBE)] = PROBE
        other = Region.attach(name, region.size)
        seen = bytes(other.buf[: len(PROBE)])
        other.close()
    finally:
        region.unlink()
        region.close()
    try:
        fd = _posixshmem.shm_open(name, os.O_RDWR, 0o600)
    except FileNotFoundError:
        cleaned = True
    else:
        os.close(fd)
        _posixshmem.shm_unlink(name)
        cleaned = False
    length = f"name {name} ({len(name)} characters, {facts.name} allows {facts.shm_name_max})"
    if seen != PROBE:
        return failed("shared_memory", f"{length}: the second mapping read {seen!r}", "report this as a bug")
    if len(name) > facts.shm_name_max:
        return failed("shared_memory", f"{length}: too long", "report this as a bug: mpsd's names must fit")
    if not cleaned:
        return failed("shared_memory", f"{length}: still there after unlink", "report this as a bug")
    return passed("shared_memory", f"{length}; mapped twice, unlinked and gone")


def _worst_pid_digits() -> int:
    """Digits of the largest pid this system hands out (Linux's pid_max; macOS stops at 99999)."""
    try:
        return len(Path("/proc/sys/kernel/pid_max").read_text().strip())
    except OSError:
        return 5


def socket_paths(setup: Setup) -> Check:
    """Bind a socket where the daemon puts its private one (for its front processes) and measure the path,
    also with the longest pid; the config's own unix:// addresses are measured too."""
    from mpsd.daemon.supervise.fronts.sockets import make_socket_dir

    limit = osfacts.current().unix_path_max
    folder = make_socket_dir()
    try:
        path = folder / "daemon.sock"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(str(path))
                bound = ""
            except OSError as exc:
                bound = f": cannot bind: {exc}"
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    used = len(os.fsencode(path)) + 1  # sun_path holds the terminating NUL
    worst = used - len(str(os.getpid())) + _worst_pid_digits()
    paths = [f"daemon socket {path} ({used} bytes, up to {worst} with the longest pid)"]
    too_long = [] if worst <= limit and not bound else [paths[0] + bound]
    if setup.config is not None:
        for setting in ("grpc_address", "http_address", "openai_address"):
            value = getattr(setup.config, setting) or ""
            if value.startswith("unix:"):
                size = len(os.fsencode(value.removeprefix("unix:").removeprefix("//"))) + 1
                paths.append(f"{setting} ({size} bytes)")
                if size > limit:
                    too_long.append(f"{setting} {value} ({size} bytes)")
    detail = f"{'; '.join(paths)}; {osfacts.current().name} allows {limit}"
    if too_long:
        return failed(
            "socket_paths",
            f"too long: {'; '.join(too_long)} ({osfacts.current().name} allows {limit} bytes)",
            "start the daemon with a short TMPDIR (e.g. TMPDIR=/tmp), or choose a shorter unix:// path",
        )
    return passed("socket_paths", detail)


def open_files(setup: Setup) -> Check:
    """The soft limit now, and whether the daemon can raise it to what it wants (the config's `open_files`
    where it has one, else WANTED_FILES): it raises its soft limit to min(hard, that) at start."""
    wanted: int = getattr(setup.config, "open_files", None) or WANTED_FILES
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    shown = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    detail = f"soft {soft}, hard {shown}"
    reachable = wanted if hard == resource.RLIM_INFINITY else min(hard, wanted)
    if soft >= wanted:
        return passed("open_files", f"{detail}, >= {wanted}")
    if reachable >= wanted:
        return passed("open_files", f"{detail}: the daemon raises its soft limit to {wanted} at start")
    return failed(
        "open_files",
        f"{detail}: the daemon can raise its soft limit only to {reachable}; {wanted} is recommended "
        "(4 descriptors per worker, 1 per client shared-memory region and per connection)",
        "raise the hard limit: LimitNOFILE=10240 in the systemd unit, /etc/security/limits.conf, or "
        "`sudo launchctl limit maxfiles 10240 unlimited` on macOS",
    )
