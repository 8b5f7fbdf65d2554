"""The daemon's open-file limit: raised at start towards `open_files`, within the hard limit and macOS's
OPEN_MAX (checked here with darwin's facts and a fake getrlimit/setrlimit), and for real: a daemon started
under macOS's 256 serves more connections at once than 256 descriptors hold, and one whose limit is pinned
low under more connections than it can take logs its accept failures a bounded number of times and serves
again once they close."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import resource
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import tritonclient.grpc as grpcclient
from conftest import RunningDaemon, http_request, wait_for

from mpsd import osfacts
from mpsd.config.daemon_config import DaemonConfig
from mpsd.daemon.open_files import raise_open_files

INFINITY = resource.RLIM_INFINITY


class FakeLimits:
    """getrlimit/setrlimit over a (soft, hard) pair; `refuse` makes setrlimit fail as the system would."""

    def __init__(self, soft: int, hard: int, refuse: OSError | None = None) -> None:
        self.limits = (soft, hard)
        self.refuse = refuse
        self.calls: list[tuple[int, int]] = []

    def get(self) -> tuple[int, int]:
        return self.limits

    def set(self, soft: int, hard: int) -> None:
        self.calls.append((soft, hard))
        if self.refuse is not None:
            raise self.refuse
        self.limits = (soft, hard)


def test_on_macos_the_soft_limit_goes_from_256_to_open_max_under_an_unlimited_hard_limit() -> None:
    """launchd and shells give 256 soft, unlimited hard; setrlimit refuses more than OPEN_MAX (10240)."""
    fake = FakeLimits(256, INFINITY)
    with osfacts.use(osfacts.DARWIN):
        done = raise_open_files(50000, fake.get, fake.set)
    assert fake.calls == [(10240, INFINITY)]  # the hard limit is left as it was
    assert (done.before, done.after, done.hard, done.error) == (256, 10240, None, None)


def test_the_hard_limit_and_the_target_bound_it() -> None:
    fake = FakeLimits(256, 4096)
    with osfacts.use(osfacts.DARWIN):
        assert raise_open_files(10240, fake.get, fake.set).after == 4096
    fake = FakeLimits(1024, 1 << 20)
    with osfacts.use(osfacts.LINUX):  # no ceiling but the hard limit on Linux
        assert raise_open_files(65536, fake.get, fake.set).after == 65536
        assert raise_open_files(DaemonConfig().open_files, fake.get, fake.set).after == 65536


def test_a_higher_limit_is_kept_and_zero_leaves_it_alone() -> None:
    for target in (0, 2048):
        fake = FakeLimits(4096, INFINITY)
        with osfacts.use(osfacts.LINUX):
            done = raise_open_files(target, fake.get, fake.set)
        assert fake.calls == []
        assert (done.before, done.after) == (4096, 4096)


def test_a_refusal_is_reported_and_the_limit_stays() -> None:
    fake = FakeLimits(256, INFINITY, refuse=OSError(errno.EINVAL, "Invalid argument"))
    with osfacts.use(osfacts.DARWIN):
        done = raise_open_files(10240, fake.get, fake.set)
    assert fake.calls == [(10240, INFINITY)]
    assert (done.before, done.after) == (256, 256)
    assert done.error is not None and "Invalid argument" in done.error


def test_the_setting_is_validated() -> None:
    assert DaemonConfig().open_files == 10240
    for wrong in (-1, (1 << 20) + 1, "many"):
        with pytest.raises(ValueError, match="open_files"):
            DaemonConfig.model_validate({"open_files": wrong})


# ---- for real ---------------------------------------------------------------------------------------------

HTTP_CONNECTIONS = 300
GRPC_CHANNELS = 60


def events(daemon: RunningDaemon, name: str) -> list[dict[str, object]]:
    found = []
    for line in daemon.log().splitlines():
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            if isinstance(event, dict) and event.get("event") == name:
                found.append(event)
    return found


async def _answered_at_once(address: str, count: int, timeout_s: float) -> list[bytes]:
    """`count` connections open together, each with a request; the status lines, all read before any
    connection closes (so the daemon holds them all at once)."""
    host, _, port = address.rpartition(":")
    writers = []
    try:

        async def one() -> bytes:
            reader, writer = await asyncio.open_connection(host, int(port))
            writers.append(writer)
            writer.write(f"GET /v2/health/live HTTP/1.1\r\nHost: {address}\r\n\r\n".encode())
            await writer.drain()
            return await reader.readline()

        return await asyncio.wait_for(asyncio.gather(*(one() for _ in range(count))), timeout_s)
    finally:
        for writer in writers:
            writer.close()


@pytest.fixture
def own_limit_raised() -> None:
    """This process holds the clients' end of every connection: on a Mac its own 256 would not do."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 4096 if hard == INFINITY else min(hard, 4096)
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


@pytest.mark.usefixtures("own_limit_raised")
def test_a_daemon_started_under_256_serves_300_http_connections_and_60_grpc_channels_at_once(
    tmp_path: Path, start_daemon
) -> None:  # type: ignore[no-untyped-def]
    repo = tmp_path / "repo"
    repo.mkdir()
    daemon = start_daemon(repo, open_files_soft=256)
    daemon.wait_ready()
    (raised,) = events(daemon, "open file limit")  # logged before the daemon listens
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    assert raised["before"] == 256
    assert raised["after"] == (10240 if hard == INFINITY else min(10240, hard))

    clients = [grpcclient.InferenceServerClient(daemon.address) for _ in range(GRPC_CHANNELS)]
    try:
        assert all(client.is_server_live(client_timeout=30) for client in clients)
        # while the 60 channels stay connected, 300 HTTP connections at once, each answered
        lines = asyncio.run(_answered_at_once(daemon.http_address, HTTP_CONNECTIONS, 60))
        assert all(line.startswith(b"HTTP/1.1 200") for line in lines), set(lines)
        assert all(client.is_server_live(client_timeout=30) for client in clients)
    finally:
        for client in clients:
            client.close()


# ---- out of descriptors: accept failures, logged at most once a second (test_accept_errors.py) -----------

ACCEPT_FAILED = "accepting connections failed"
ASYNCIO_LINE = "socket.accept() out of system resource"  # what asyncio's own handler writes, each time
CONNECTIONS = 150  # a daemon of 64 descriptors holds about 40 of them; the rest wait in the accept queue


def accept_failures(daemon: RunningDaemon) -> list[dict[str, Any]]:
    found = []
    for line in daemon.log().splitlines():
        if line.startswith("{"):
            event = json.loads(line)
            if event.get("event") == ACCEPT_FAILED:
                found.append(event)
    return found


def test_a_daemon_out_of_descriptors_logs_it_a_bounded_number_of_times_and_serves_again(
    tmp_path: Path, start_daemon
) -> None:  # type: ignore[no-untyped-def]
    repo = tmp_path / "repo"
    repo.mkdir()
    config = tmp_path / "mpsd.yaml"
    config.write_text("open_files: 64\n")  # not raised beyond where it starts
    daemon = start_daemon(repo, config=config, open_files_soft=64)
    daemon.wait_ready()
    host, _, port = daemon.http_address.rpartition(":")
    started = time.monotonic()
    held = [socket.create_connection((host, int(port)), timeout=30) for _ in range(CONNECTIONS)]
    try:
        # the failures of asyncio's first pass over its backlog, held back and told at the interval's end
        wait_for(
            lambda: any(e["suppressed"] > 0 for e in accept_failures(daemon)),
            30,
            f"{ACCEPT_FAILED} with a count",
        )
    finally:
        for sock in held:
            sock.close()
    wait_for(
        lambda: http_request(daemon.http_address, "GET", "/v2/health/live", timeout=5)[0] == 200,
        60,
        "the daemon serving HTTP again",
    )
    assert daemon.client.is_server_live()
    elapsed = time.monotonic() - started
    told = accept_failures(daemon)
    assert ASYNCIO_LINE not in daemon.log()  # asyncio's own handler, a traceback per failure, never ran
    assert len(told) <= elapsed + 2, (len(told), elapsed)  # one a second at most (and the last count)
    assert told[0]["errno"] == "EMFILE" and told[0]["address"] == daemon.http_address
