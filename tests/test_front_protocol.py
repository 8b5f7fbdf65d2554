"""The CONFIG, AUTH and READY frames between the daemon and a front: typed on both ends, the same JSON on the
wire as before they were typed, and a payload the two ends disagree on refused with the frame and the field
named."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
from typing import Any

import pytest

from mpsd.config.daemon_config import DaemonConfig
from mpsd.config.security import AuthConfig, Token
from mpsd.daemon.supervise.fronts.link import FrontFailed, FrontLink
from mpsd.ipc.front_protocol import ArenaRegion, FrontAccess, FrontConfig, FrontReady, MalformedMessage
from mpsd.ipc.front_wire import HEADER, Kind, frame
from mpsd.net.auth import export_tokens, import_tokens
from mpsd.net.certificates import TlsMaterial
from tests.conftest import ROOT

TOKENS = [Token(b"s3cret", frozenset({"inference", "health"}), "token_file /etc/t")]
TLS = TlsMaterial(b"-----CHAIN-----\n", b"-----PRIVATE KEY-----\n", b"-----CA-----\n")


def access(tls: TlsMaterial | None = TLS) -> FrontAccess:
    """As the pool builds it."""
    return FrontAccess(
        AuthConfig().model_dump(mode="json"),
        tuple(export_tokens(TOKENS)),
        tls.export() if tls is not None else None,
    )


ARENA = ArenaRegion("/mpsd-arena", 16 << 20)


def config(arena: ArenaRegion | None = ARENA) -> FrontConfig:
    daemon = DaemonConfig().model_dump(mode="json")
    return FrontConfig(2, "info", "unix:/run/daemon.sock", daemon, arena, access(), "127.0.0.1:8013", False)


@pytest.mark.parametrize("arena", [ARENA, None])
def test_config_auth_and_ready_come_back_as_they_were_sent(arena: ArenaRegion | None) -> None:
    sent = config(arena)
    assert FrontConfig.decode(sent.encode()) == sent
    for each in (access(), access(tls=None)):
        assert FrontAccess.decode(each.encode()) == each
    assert FrontReady.decode(FrontReady(4242, "uvloop").encode()) == FrontReady(4242, "uvloop")
    assert FrontReady.decode(FrontReady(7, "asyncio", 200).encode()) == FrontReady(7, "asyncio", 200)
    assert FrontReady.decode(FrontReady(7, "asyncio", 0, 9).encode()) == FrontReady(7, "asyncio", 0, 9)
    # What the front turns them into: the daemon's own settings, tokens and certificate.
    got = FrontConfig.decode(sent.encode())
    assert DaemonConfig.model_validate(got.config) == DaemonConfig()
    assert AuthConfig.model_validate(got.access.auth) == AuthConfig()
    assert import_tokens(got.access.tokens) == TOKENS
    assert got.access.tls is not None and TlsMaterial.load(got.access.tls) == TLS


def test_the_wire_keeps_its_json() -> None:
    """The same keys as the dicts the two ends used to build: access settings beside the others in CONFIG."""
    sent = json.loads(config().encode())
    keys = ["index", "log_level", "daemon_target", "config", "arena", "auth", "tokens", "tls"]
    assert list(sent) == [*keys, "address", "share_port"]
    assert (sent["address"], sent["share_port"]) == ("127.0.0.1:8013", False)
    assert sent["arena"] == {"name": "/mpsd-arena", "size": 16 << 20}
    assert sent["tokens"] == export_tokens(TOKENS) and sent["tls"] == TLS.export()
    assert json.loads(config(None).encode())["arena"] is None
    assert json.loads(access().encode()) == {
        "auth": sent["auth"],
        "tokens": sent["tokens"],
        "tls": sent["tls"],
    }
    assert json.loads(FrontReady(7, "asyncio", 200, 50_000).encode()) == {
        "pid": 7,
        "event_loop": "asyncio",
        "busy_poll_us": 200,
        "frozen_objects": 50_000,
    }


def test_secrets_stay_out_of_a_repr() -> None:
    shown = repr(config())
    assert "s3cret" not in shown and "PRIVATE KEY" not in shown


def _config_with(**changes: Any) -> bytes:
    data = json.loads(config().encode())
    for key, value in changes.items():
        if value is ...:
            del data[key]
        else:
            data[key] = value
    return json.dumps(data).encode()


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"\xff{", "malformed CONFIG frame: not JSON"),
        (b"[1, 2]", "malformed CONFIG frame: the payload must be an object, not list"),
        (_config_with(index=...), "malformed CONFIG frame: no 'index'"),
        (_config_with(index="2"), "malformed CONFIG frame: 'index' must be int, not str"),
        (_config_with(index=True), "malformed CONFIG frame: 'index' must be int, not bool"),
        (_config_with(config=None), "malformed CONFIG frame: 'config' must be dict, not null"),
        (_config_with(arena=[1]), "malformed CONFIG frame: 'arena' must be dict or null, not list"),
        (_config_with(arena={"name": "/a"}), "malformed CONFIG frame: no 'arena.size'"),
        (_config_with(arena={"name": "/a", "size": 1.5}), "'arena.size' must be int, not float"),
        (_config_with(tokens=[{"secret": "s"}]), "malformed CONFIG frame: no 'tokens[0].categories'"),
        (
            _config_with(tokens=[{"secret": "s", "categories": [1], "source": "x"}]),
            "'tokens[0].categories' must be a list of str",
        ),
        (_config_with(tls={"chain": "c", "key": "k", "client_ca": 3}), "'tls.client_ca' must be str or null"),
        (_config_with(tls={"chain": "c", "key": "k"}), "no 'tls.client_ca'"),
        (_config_with(auth=...), "malformed CONFIG frame: no 'auth'"),
        (_config_with(address=...), "malformed CONFIG frame: no 'address'"),
        (_config_with(share_port=1), "malformed CONFIG frame: 'share_port' must be bool, not int"),
        (_config_with(colour="blue"), "malformed CONFIG frame: unknown field(s) 'colour'"),
    ],
)
def test_a_malformed_config_says_which_field(payload: bytes, message: str) -> None:
    with pytest.raises(MalformedMessage) as caught:
        FrontConfig.decode(payload)
    assert message in caught.value.message


def test_a_malformed_auth_or_ready_says_which_field() -> None:
    with pytest.raises(MalformedMessage, match=r"malformed AUTH frame: 'tokens' must be list, not dict"):
        FrontAccess.decode(json.dumps({**access().fields(), "tokens": {}}).encode())
    with pytest.raises(MalformedMessage, match=r"malformed AUTH frame: unknown field\(s\) 'index'"):
        FrontAccess.decode(json.dumps({**access().fields(), "index": 1}).encode())
    with pytest.raises(MalformedMessage, match=r"malformed READY frame: no 'event_loop'"):
        FrontReady.decode(b'{"pid": 1}')


def test_a_malformed_ready_fails_the_front_start_with_the_reason() -> None:
    async def run() -> None:
        link = FrontLink(0, None, lambda _: None)  # type: ignore[arg-type]
        link._on_frame(Kind.READY, 0, 0.0, b'{"pid": "one", "event_loop": "asyncio", "busy_poll_us": 0}')
        with pytest.raises(FrontFailed, match=r"malformed READY frame: 'pid' must be int, not str"):
            await link.ready

    asyncio.run(run())


def test_a_front_sent_a_malformed_config_answers_failed_with_the_reason() -> None:
    daemon_end, front_end = socket.socketpair()
    front = subprocess.Popen(
        [sys.executable, "-m", "mpsd.front", "--fd", str(front_end.fileno())],
        pass_fds=(front_end.fileno(),),
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
    )
    front_end.close()
    try:
        daemon_end.sendall(b"".join(frame(Kind.CONFIG, payload=_config_with(index="0"))))
        daemon_end.settimeout(30)
        received = b""
        while len(received) < HEADER.size or len(received) < HEADER.size + HEADER.unpack_from(received)[3]:
            chunk = daemon_end.recv(65536)
            assert chunk, "the front closed its end without saying why"
            received += chunk
        kind, _, _, length = HEADER.unpack_from(received)
        reason = received[HEADER.size : HEADER.size + length].decode()
        assert kind == Kind.FAILED
        assert reason == "MalformedMessage: malformed CONFIG frame: 'index' must be int, not str"
        assert front.wait(30) == 1
    finally:
        daemon_end.close()
        if front.poll() is None:
            front.kill()
            front.wait()
