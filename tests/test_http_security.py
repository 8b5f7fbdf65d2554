"""The HTTP port keeps the gRPC port's security settings, checked against real daemons:

- mutual TLS: no client certificate, one from another CA, or plain text: no conversation;
- bearer tokens with the same categories (401 without a valid token, 403 naming the category);
- a Unix socket of mode 0600; repository changes without tokens only where only this host can connect,
  judged on the HTTP address itself;
- SIGHUP: a renewed certificate for the next handshake (with a server name or without), rotated tokens.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import ssl
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests import models
from tests.conftest import RunningDaemon, free_port, http_request, wait_for
from tests.test_security import ADMIN_ENV, ADMIN_TOKEN, INFER_TOKEN, READER_TOKEN, Pki, bearer, make_pki
from tests.test_security import write_daemon_config as write_config

INFER_BODY = json.dumps(
    {
        "inputs": [
            {"name": n, "shape": [1, 16], "datatype": "FP32", "data": [1.0] * 16}
            for n in ("INPUT0", "INPUT1")
        ]
    }
).encode()


def https(
    address: str,
    path: str,
    ca: Path,
    cert: Path | None = None,
    key: Path | None = None,
    method: str = "GET",
    body: bytes = b"",
    headers: dict[str, str] | None = None,
) -> tuple[int, Any, dict[str, str]]:
    """One HTTPS request: (status, JSON body or None, headers). An IP address sends no server name."""
    context = ssl.create_default_context(cafile=str(ca))
    if cert is not None:
        context.load_cert_chain(str(cert), str(key))
    host, _, port = address.rpartition(":")
    connection = http.client.HTTPSConnection(host, int(port), context=context, timeout=30)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        data = response.read()
        parsed = (
            json.loads(data) if data and response.getheader("Content-Type") == "application/json" else None
        )
        return response.status, parsed, dict(response.getheaders())
    finally:
        connection.close()


def unix_request(path: Path, method: str, url: str, body: bytes = b"") -> tuple[int, Any]:
    class Connection(http.client.HTTPConnection):
        def connect(self) -> None:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.connect(str(path))

    connection = Connection("localhost", timeout=30)
    try:
        connection.request(method, url, body=body)
        response = connection.getresponse()
        data = response.read()
        return response.status, json.loads(data) if data else None
    finally:
        connection.close()


@dataclass
class Daemons:
    pki: Pki
    mtls: RunningDaemon  # mutual TLS and tokens on both ports
    local: RunningDaemon  # HTTP on a Unix socket, no tokens
    socket_path: Path
    open: RunningDaemon  # HTTP on every interface over TLS, gRPC on loopback, no tokens


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory, module_sock_dir: Path) -> Iterator[Daemons]:
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    started: list[RunningDaemon] = []
    try:
        base = tmp_path_factory.mktemp("mtls")
        models.add_sub(base / "repo")
        (base / "infer.token").write_text(INFER_TOKEN)
        (base / "reader.token").write_text(READER_TOKEN)
        for name in ("infer.token", "reader.token"):
            (base / name).chmod(0o600)
        tls = {"cert_file": str(pki.server_cert), "key_file": str(pki.server_key)}
        config = write_config(
            base / "mpsd.yaml",
            tls={**tls, "client_ca_file": str(pki.ca)},
            auth={
                "tokens": [
                    {"token_file": "infer.token", "categories": ["inference"]},
                    {"token_file": "reader.token", "categories": ["health", "logs-statistics"]},
                    {"token_env": ADMIN_ENV, "categories": ["inference", "health", "model-repository"]},
                ]
            },
        )
        mtls = RunningDaemon(
            base / "repo",
            base / "daemon.log",
            config=config,
            extra_args=["--http-address", f"localhost:{free_port()}"],
            env={ADMIN_ENV: ADMIN_TOKEN},
        )
        mtls.client = grpcclient.InferenceServerClient(
            mtls.address,
            ssl=True,
            root_certificates=str(pki.ca),
            private_key=str(pki.client_key),
            certificate_chain=str(pki.client_cert),
        )
        started.append(mtls)

        base = tmp_path_factory.mktemp("local")
        models.add_sub(base / "repo")
        sock = module_sock_dir / "http.sock"
        stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stale.bind(str(sock))  # left behind by a daemon killed with -9
        stale.close()
        local = RunningDaemon(
            base / "repo",
            base / "daemon.log",
            config=write_config(base / "mpsd.yaml"),
            extra_args=["--http-address", f"unix://{sock}"],
        )
        started.append(local)

        base = tmp_path_factory.mktemp("open")
        models.add_sub(base / "repo")
        port = free_port()
        opened = RunningDaemon(
            base / "repo",
            base / "daemon.log",
            config=write_config(base / "mpsd.yaml", tls=tls),
            extra_args=["--http-address", f"0.0.0.0:{port}"],
        )
        opened.http_address = f"127.0.0.1:{port}"
        opened.client = grpcclient.InferenceServerClient(
            opened.address, ssl=True, root_certificates=str(pki.ca)
        )
        started.append(opened)
        local.wait_ready()
        opened.wait_ready()
        wait_for(lambda: mtls.client.is_server_ready(headers=bearer(ADMIN_TOKEN)), 120, mtls.log())
        yield Daemons(pki, mtls, local, sock, opened)
    finally:
        for daemon in started:
            daemon.stop()
            daemon.kill_group()


# ---- TLS ---------------------------------------------------------------------------------------------------


def test_mutual_tls_refuses_clients_without_a_trusted_certificate(daemons: Daemons) -> None:
    pki, address = daemons.pki, daemons.mtls.http_address
    admin = bearer(ADMIN_TOKEN)
    assert (
        https(address, "/v2/health/ready", pki.ca, pki.client_cert, pki.client_key, headers=admin)[0] == 200
    )
    for cert, key in ((None, None), (pki.stranger_cert, pki.stranger_key)):
        with pytest.raises((ssl.SSLError, ConnectionError)):
            https(address, "/v2/health/ready", pki.ca, cert, key, headers=admin)
    with pytest.raises((http.client.HTTPException, ConnectionError)):
        http_request(address, "GET", "/v2/health/ready", headers=admin)


@pytest.mark.filterwarnings("ignore:ssl.match_hostname:DeprecationWarning")  # geventhttpclient's own check
def test_the_stock_client_speaks_mutual_tls_and_tokens(daemons: Daemons) -> None:
    import gevent.ssl

    pki = daemons.pki

    def context() -> Any:
        made = gevent.ssl.create_default_context(cafile=str(pki.ca))
        made.load_cert_chain(str(pki.client_cert), str(pki.client_key))
        return made

    address = daemons.mtls.http_address
    client = httpclient.InferenceServerClient(address, ssl=True, ssl_context_factory=context)
    try:
        a = np.ones((1, 16), np.float32)
        inputs = [httpclient.InferInput(n, [1, 16], "FP32") for n in ("INPUT0", "INPUT1")]
        for inp in inputs:
            inp.set_data_from_numpy(a)
        result = client.infer("add_sub", inputs, headers=bearer(INFER_TOKEN))
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a * 2)
        with pytest.raises(httpclient.InferenceServerException) as err:
            client.infer("add_sub", inputs, headers=bearer(READER_TOKEN))
        assert err.value.status() == "403" and "'inference'" in err.value.message()
    finally:
        client.close()


def test_server_only_tls_refuses_plain_text(daemons: Daemons) -> None:
    assert https(daemons.open.http_address, "/v2/health/live", daemons.pki.ca)[0] == 200
    with pytest.raises((http.client.HTTPException, ConnectionError)):
        http_request(daemons.open.http_address, "GET", "/v2/health/live")


# ---- tokens ------------------------------------------------------------------------------------------------


def test_tokens_open_their_categories_only(daemons: Daemons) -> None:
    pki, address = daemons.pki, daemons.mtls.http_address

    def call(path: str, token: str | None, method: str = "GET", body: bytes = b"") -> tuple[int, Any, Any]:
        headers = bearer(token) if token is not None else {}
        return https(address, path, pki.ca, pki.client_cert, pki.client_key, method, body, headers)

    for token in (None, "not-a-token", INFER_TOKEN + "x"):
        status, reply, headers = call("/v2/models/add_sub/infer", token, "POST", INFER_BODY)
        assert status == 401 and headers.get("WWW-Authenticate") == "Bearer", reply
        assert "ModelInfer" in reply["error"] and "inference" in reply["error"]
    status, reply, _ = call("/v2/health/live", None)
    assert status == 401 and "Bearer" in reply["error"]
    denied = {
        "health": ("/v2/health/ready", INFER_TOKEN, "GET"),
        "model-repository": ("/v2/repository/models/add_sub/load", INFER_TOKEN, "POST"),
        "logs-statistics": ("/v2/models/add_sub/stats", INFER_TOKEN, "GET"),
        "inference": ("/v2/models/add_sub/infer", READER_TOKEN, "POST"),
    }
    for category, (path, token, method) in denied.items():
        status, reply, _ = call(path, token, method, INFER_BODY if method == "POST" else b"")
        assert status == 403 and f"'{category}'" in reply["error"], (category, reply)
    assert call("/v2/models/add_sub/infer", INFER_TOKEN, "POST", INFER_BODY)[0] == 200
    assert call("/v2/models/add_sub/stats", READER_TOKEN)[0] == 200
    assert call("/v2/repository/models/add_sub/load", ADMIN_TOKEN, "POST")[0] == 200


def test_a_refused_call_is_answered_before_its_body_is_read(daemons: Daemons) -> None:
    """401 comes back while the body the request declares has not been sent at all."""
    pki = daemons.pki
    context = ssl.create_default_context(cafile=str(pki.ca))
    context.load_cert_chain(str(pki.client_cert), str(pki.client_key))
    host, _, port = daemons.mtls.http_address.rpartition(":")
    with (
        socket.create_connection((host, int(port)), timeout=30) as raw,
        context.wrap_socket(raw, server_hostname=host) as sock,
    ):
        sock.sendall(
            b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\n\r\n"
        )
        reply = sock.recv(65536).decode("latin-1")
    assert reply.startswith("HTTP/1.1 401"), reply


def test_expect_100_continue_is_answered_only_once_the_call_is_admitted(daemons: Daemons) -> None:
    """A client that sends `Expect: 100-continue` holds its body back until told to go on: a call refused
    by access control, or a body declared over max_message_bytes, gets its final status instead of the
    go-ahead, so the body is never sent; an admitted one gets 100 Continue, then its answer."""
    pki = daemons.pki
    context = ssl.create_default_context(cafile=str(pki.ca))
    context.load_cert_chain(str(pki.client_cert), str(pki.client_key))
    host, _, port = daemons.mtls.http_address.rpartition(":")
    tensors = [
        {"name": n, "shape": [1, 16], "datatype": "FP32", "data": [1.0] * 16} for n in ("INPUT0", "INPUT1")
    ]
    body = json.dumps({"inputs": tensors}).encode()

    def first_reply(token: str | None, length: int) -> tuple[ssl.SSLSocket, socket.socket, str]:
        raw = socket.create_connection((host, int(port)), timeout=30)
        sock = context.wrap_socket(raw, server_hostname=host)
        auth = f"Authorization: Bearer {token}\r\n" if token else ""
        head = f"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: x\r\n{auth}Expect: 100-continue\r\n"
        sock.sendall(f"{head}Content-Length: {length}\r\n\r\n".encode())
        return sock, raw, sock.recv(65536).decode("latin-1")

    for token, length, status in ((None, len(body), "401"), (INFER_TOKEN, 2**40, "413")):
        sock, raw, reply = first_reply(token, length)
        with raw, sock:
            assert reply.startswith(f"HTTP/1.1 {status}"), reply
            assert "100 Continue" not in reply

    sock, raw, reply = first_reply(INFER_TOKEN, len(body))
    with raw, sock:
        assert reply == "HTTP/1.1 100 Continue\r\n\r\n", reply
        sock.sendall(body)
        answer = sock.recv(65536).decode("latin-1")
    assert answer.startswith("HTTP/1.1 200"), answer
    assert '"OUTPUT0"' in answer


# ---- Unix socket and repository changes -----------------------------------------------------------------


def test_unix_socket_is_mode_0600_replaces_a_stale_one_and_serves(daemons: Daemons) -> None:
    mode = daemons.socket_path.stat().st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600, oct(mode)
    assert unix_request(daemons.socket_path, "GET", "/v2/health/ready")[0] == 200
    status, reply = unix_request(daemons.socket_path, "POST", "/v2/models/add_sub/infer", INFER_BODY)
    assert status == 200 and reply["outputs"][0]["data"] == [2.0] * 16
    if shutil.which("curl"):
        import subprocess

        done = subprocess.run(
            ["curl", "-sf", "--unix-socket", str(daemons.socket_path), "http://localhost/v2"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert json.loads(done.stdout)["name"] == "mpsd"


def test_repository_changes_without_tokens_follow_the_http_address(daemons: Daemons) -> None:
    """HTTP on 0.0.0.0 refuses them although gRPC (loopback) accepts them; a Unix socket accepts them."""
    status, reply, _ = https(
        daemons.open.http_address, "/v2/repository/models/x/load", daemons.pki.ca, method="POST"
    )
    assert status == 403, reply
    for words in ("0.0.0.0", "auth.tokens", "repository_changes_without_token: allow"):
        assert words in reply["error"], reply
    with pytest.raises(Exception) as err:
        daemons.open.client.load_model("not_in_repo")
    assert "failed to poll from model repository" in str(err.value), err.value  # gRPC on loopback: allowed
    assert unix_request(daemons.socket_path, "POST", "/v2/repository/models/not_in_repo/load")[0] == 500


# ---- SIGHUP ---------------------------------------------------------------------------------------------


def test_sighup_renews_the_certificate_and_rotates_tokens_on_http(tmp_path: Path) -> None:
    for name in ("old", "new", "live"):
        (tmp_path / name).mkdir()
    old, new, live = make_pki(tmp_path / "old"), make_pki(tmp_path / "new"), tmp_path / "live"
    shutil.copy(old.server_cert, live / "server.pem")
    shutil.copy(old.server_key, live / "server.key")
    token = tmp_path / "rotating.token"
    token.write_text("first-token")
    token.chmod(0o600)
    repo = tmp_path / "repo"
    models.add_sub(repo)
    config = write_config(
        tmp_path / "mpsd.yaml",
        tls={"cert_file": "live/server.pem", "key_file": "live/server.key"},
        auth={
            "tokens": [{"token_file": "rotating.token", "categories": ["inference"]}],
            "open_categories": ["health"],
        },
    )
    port = free_port()
    daemon = RunningDaemon(
        repo, tmp_path / "daemon.log", config=config, extra_args=["--http-address", f"localhost:{port}"]
    )
    named, unnamed = f"localhost:{port}", f"127.0.0.1:{port}"  # with a server name (SNI) and without
    try:
        wait_for(lambda: https(named, "/v2/health/ready", old.ca)[0] == 200, 120, daemon.log())
        infer = ("/v2/models/add_sub/infer", old.ca, None, None, "POST", INFER_BODY)
        assert https(named, *infer, headers=bearer("first-token"))[0] == 200
        shutil.copy(new.server_cert, live / "server.pem")
        shutil.copy(new.server_key, live / "server.key")
        token.write_text("second-token")
        os.kill(daemon.pid, signal.SIGHUP)
        wait_for(lambda: "certificates reloaded" in daemon.log(), 30, "certificates reloaded")
        for address in (named, unnamed):
            assert https(address, "/v2/health/live", new.ca)[0] == 200, address
            with pytest.raises(ssl.SSLError):
                https(address, "/v2/health/live", old.ca)
        new_infer = ("/v2/models/add_sub/infer", new.ca, None, None, "POST", INFER_BODY)
        assert https(named, *new_infer, headers=bearer("first-token"))[0] == 401
        assert https(named, *new_infer, headers=bearer("second-token"))[0] == 200
    finally:
        daemon.stop()
        daemon.kill_group()
