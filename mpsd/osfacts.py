"""What the operating system allows, in one place, so code and tests can ask for darwin's facts on Linux.

Every limit or behaviour that differs between Linux and macOS and that mpsd depends on is a field of
`OsFacts`. Code reads `current()`; a test puts darwin's facts in force with `use(DARWIN)` (in one process)
or with `MPSD_OS_FACTS=darwin` in a child's environment, so macOS behaviour is exercised here rather than
skipped. Each darwin value names its source in docs/macos.md.

This module imports nothing of mpsd: every process role and layer may read it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace

ENV = "MPSD_OS_FACTS"


@dataclass(frozen=True)
class OsFacts:
    """One operating system's limits and behaviours, as mpsd meets them."""

    name: str
    # AF_UNIX sun_path in bytes, the terminating NUL included (Linux 108, macOS 104).
    unix_path_max: int
    # A POSIX shared-memory name's length, the leading slash included (Linux NAME_MAX, XNU PSHMNAMLEN).
    shm_name_max: int
    # Where POSIX shared memory can be listed, or None where the system offers no directory (macOS).
    shm_dir: str | None
    # Whether a shared-memory object may be sized more than once (XNU allows one ftruncate per object).
    shm_resizable: bool
    # The soft open-file limit a shell or service starts with, before mpsd raises it.
    default_nofile_soft: int
    # The highest soft open-file limit setrlimit accepts (macOS: OPEN_MAX; more is EINVAL), or None.
    nofile_ceiling: int | None
    # Whether file-change events name the real (symlink-resolved) path of the watched folder (FSEvents).
    events_use_real_paths: bool
    # The errnos a full datagram socket answers a non-blocking send with (macOS adds ENOBUFS).
    dgram_full_errnos: frozenset[int]
    # Folders, relative to the home directory, that a launchd job may not read without a privacy grant.
    tcc_home_folders: tuple[str, ...]
    # Absolute folders with the same restriction (removable and network volumes).
    tcc_roots: tuple[str, ...]
    # Whether host RAM and GPU memory are one pool (Apple Silicon).
    unified_memory: bool
    # Whether several processes can share one listening port with the kernel balancing connections.
    reuseport_balances: bool
    # Whether an idle system goes to sleep under a serving daemon unless it holds an assertion.
    idle_sleeps: bool
    # Whether a wildcard listener on a port still lets another socket bind 127.0.0.1 on it (BSD).
    specific_bind_beside_wildcard: bool
    # How the system's package manager installs the tools some tests use.
    package_hint: str


LINUX = OsFacts(
    name="linux",
    unix_path_max=108,
    shm_name_max=255,
    shm_dir="/dev/shm",
    shm_resizable=True,
    default_nofile_soft=1024,
    nofile_ceiling=None,
    events_use_real_paths=False,
    dgram_full_errnos=frozenset({errno.EAGAIN}),
    tcc_home_folders=(),
    tcc_roots=(),
    unified_memory=False,
    reuseport_balances=True,
    idle_sleeps=False,
    specific_bind_beside_wildcard=False,
    package_hint="apt-get install libplist-utils nghttp2-client haproxy chromium chromium-driver",
)

DARWIN = OsFacts(
    name="darwin",
    unix_path_max=104,
    shm_name_max=31,
    shm_dir=None,
    shm_resizable=False,
    default_nofile_soft=256,
    nofile_ceiling=10240,
    events_use_real_paths=True,
    dgram_full_errnos=frozenset({errno.EAGAIN, errno.ENOBUFS}),
    tcc_home_folders=("Desktop", "Documents", "Downloads", "Library/Mobile Documents"),
    tcc_roots=("/Volumes",),
    unified_memory=True,
    reuseport_balances=False,
    idle_sleeps=True,
    specific_bind_beside_wildcard=True,
    package_hint="brew install libplist nghttp2 haproxy && brew install --cask chromium chromedriver",
)

_KNOWN = {facts.name: facts for facts in (LINUX, DARWIN)}


def for_platform(platform: str) -> OsFacts:
    """The facts of `platform` (a `sys.platform` value); other systems are taken as Linux-like."""
    if platform == "darwin":
        return DARWIN
    return LINUX if platform.startswith("linux") else replace(LINUX, name=platform)


def _initial() -> OsFacts:
    name = os.environ.get(ENV, "")
    if name:
        if name not in _KNOWN:
            raise ValueError(f"{ENV}={name!r}: expected one of {sorted(_KNOWN)}")
        return _KNOWN[name]
    return for_platform(sys.platform)


_current = _initial()


def current() -> OsFacts:
    """The facts in force for this process."""
    return _current


@contextlib.contextmanager
def use(facts: OsFacts) -> Iterator[OsFacts]:
    """Put `facts` in force for the block (tests inject macOS's facts this way)."""
    global _current
    before = _current
    _current = facts
    try:
        yield facts
    finally:
        _current = before


def child_env(facts: OsFacts | None = None) -> dict[str, str]:
    """The environment entry that gives a child process the same facts (empty for the real system's)."""
    facts = facts or _current
    return {} if facts == for_platform(sys.platform) else {ENV: facts.name}


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity (`taskset`, systemd's `CPUAffinity=`, a container's
    cpuset), not every CPU of the machine. macOS has no affinity (no `os.sched_getaffinity`): all of them."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
