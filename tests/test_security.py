"""Security promises, each checked against a real daemon where it matters:

- a Unix socket is created mode 0600 (a stale one from a dead daemon is replaced) and serves tritonclient;
- TLS and mutual TLS with certificates made here: no client certificate, one from another CA, or plain
  text: no conversation;
- bearer tokens: none or a wrong one is UNAUTHENTICATED, one without the RPC's category is
  PERMISSION_DENIED naming the category;
- without tokens, repository changes are accepted only where only this host can connect;
- model names cannot leave the repository, symlinks out of it are refused unless allowed;
- a model file that needs pickle is refused unless its config says `allow_pickle: true`.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import pickle
import socket
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from torch import nn
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

from mpsd.config.daemon_config import load_daemon_config
from mpsd.config.security import AuthConfig, Token
from mpsd.errors import ConfigError
from mpsd.net.auth import METHOD_CATEGORY, REPOSITORY_CHANGES, AccessPolicy, category_of
from mpsd.net.listen import parse_address, remove_stale_socket
from mpsd.worker.backends.pickled import PickleRefused, archive_kind, no_unpickling
from tests import models
from tests.conftest import ROOT, RunningDaemon, free_port, wait_for
from tests.os_skips import shared_port_fronts

INFER_TOKEN = "infer-token-1f0c"
READER_TOKEN = "reader-token-77ab"
ADMIN_TOKEN = "admin-token-c93e"
ADMIN_ENV = "MPSD_TEST_ADMIN_TOKEN"


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


# ---- certificates -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    stranger_cert: Path  # a client certificate from a CA the server does not trust
    stranger_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _issue(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[str, ec.EllipticCurvePrivateKey] | None,
    usage: str,
) -> x509.Certificate:
    """A certificate for `key`; self-signed CA when issuer is None, else signed by (issuer name, key)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    issuer_name, signing_key = issuer if issuer is not None else (subject, key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=usage == "ca", path_length=None), critical=True)
    )
    if usage == "ca":
        builder = builder.add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    elif usage == "server":
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [
                    x509.DNSName("localhost"),
                    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                    x509.IPAddress(ipaddress.ip_address("::1")),
                ]
            ),
            critical=False,
        ).add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    else:
        builder = builder.add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
    return builder.sign(signing_key, hashes.SHA256())


def _write(directory: Path, name: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Path:
    (directory / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path = directory / f"{name}.key"
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    key_path.chmod(0o600)
    return directory / f"{name}.pem"


def make_pki(directory: Path) -> Pki:
    keys = {
        n: ec.generate_private_key(ec.SECP256R1()) for n in ("ca", "server", "client", "other", "stranger")
    }
    ca = _issue("mpsd test CA", keys["ca"], None, "ca")
    _write(directory, "ca", ca, keys["ca"])
    _write(
        directory,
        "server",
        _issue("localhost", keys["server"], ("mpsd test CA", keys["ca"]), "server"),
        keys["server"],
    )
    _write(
        directory,
        "client",
        _issue("client", keys["client"], ("mpsd test CA", keys["ca"]), "client"),
        keys["client"],
    )
    _write(
        directory,
        "stranger",
        _issue("stranger", keys["stranger"], ("another CA", keys["other"]), "client"),
        keys["stranger"],
    )
    return Pki(
        ca=directory / "ca.pem",
        server_cert=directory / "server.pem",
        server_key=directory / "server.key",
        client_cert=directory / "client.pem",
        client_key=directory / "client.key",
        stranger_cert=directory / "stranger.pem",
        stranger_key=directory / "stranger.key",
    )


# ---- daemons ----------------------------------------------------------------------------------------


def write_daemon_config(path: Path, **settings: Any) -> Path:
    path.write_text(yaml.safe_dump({"metrics_address": "", "reload_quiet_period_s": 0.3, **settings}))
    return path


def start_daemon(
    base: Path, repo: Path, config: Path, listen: str, client: grpcclient.InferenceServerClient, **kw: Any
) -> RunningDaemon:
    """A daemon listening on `listen`, talked to with `client` (RunningDaemon's own client is TCP/plain)."""
    daemon = RunningDaemon(
        repo, base / "daemon.log", extra_args=["--grpc-address", listen], config=config, **kw
    )
    daemon.client.close()
    daemon.client = client
    return daemon


def wait_settled(daemon: RunningDaemon, headers: dict[str, str] | None = None, timeout: float = 120) -> None:
    """Until the daemon answers and no model is LOADING."""

    def settled() -> bool:
        if daemon.proc.poll() is not None:
            raise AssertionError(f"daemon exited with {daemon.proc.returncode}:\n{daemon.log()}")
        index = daemon.client.get_model_repository_index(headers=headers, as_json=True).get("models", [])
        return all(m.get("state") != "LOADING" for m in index)

    wait_for(settled, timeout, f"models settled\n{daemon.log()}")


def index_of(daemon: RunningDaemon, headers: dict[str, str] | None = None) -> dict[str, dict[str, str]]:
    rows = daemon.client.get_model_repository_index(headers=headers, as_json=True).get("models", [])
    return {row["name"]: row for row in rows}


def torch_saved_relu(repo: Path, name: str, allow_pickle: bool) -> Path:
    """`torch.save(module)`, the pickle format, under backend: torchscript."""
    model_dir = repo / name
    config: dict[str, Any] = {
        "backend": "torchscript",
        "max_batch_size": 0,
        "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [-1]}],
        "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [-1]}],
    }
    if allow_pickle:
        config["allow_pickle"] = True
    models.write_config(model_dir, config)
    (model_dir / "1").mkdir()
    torch.save(nn.Sequential(nn.ReLU()), model_dir / "1" / "model.pt")
    return model_dir


LINEAR_WEIGHT = np.arange(16, dtype=np.float32).reshape(4, 4) / 10
LINEAR_BIAS = np.array([1, -1, 0.5, 0], np.float32)


def exported_linear(repo: Path, name: str) -> Path:
    """A torch.export program with weights, loaded without any unpickling."""
    model_dir = repo / name
    models.write_config(
        model_dir,
        {
            "backend": "torch_export",
            "max_batch_size": 0,
            "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [4]}],
            "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [4]}],
        },
    )
    linear = nn.Linear(4, 4)
    with torch.no_grad():
        linear.weight.copy_(torch.from_numpy(LINEAR_WEIGHT))
        linear.bias.copy_(torch.from_numpy(LINEAR_BIAS))
    (model_dir / "1").mkdir()
    torch.export.save(torch.export.export(linear, (torch.zeros(4),)), str(model_dir / "1" / "model.pt2"))
    return model_dir


@dataclass
class Daemons:
    unix: RunningDaemon
    unix_socket: Path
    mtls: RunningDaemon
    pki: Pki
    tls_open: RunningDaemon  # TLS, no tokens, listening on every interface


def _mtls_client(address: str, pki: Pki, cert: Path | None = None, key: Path | None = None) -> Any:
    return grpcclient.InferenceServerClient(
        address,
        ssl=True,
        root_certificates=str(pki.ca),
        private_key=str(key or pki.client_key),
        certificate_chain=str(cert or pki.client_cert),
    )


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory, module_sock_dir: Path) -> Iterator[Daemons]:
    """Three daemons started together (their workers load in parallel)."""
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    started: list[RunningDaemon] = []
    try:
        # 1. A Unix socket, symlinks allowed, models that need or refuse pickle, an exported program.
        base = tmp_path_factory.mktemp("unix")
        outside = base / "elsewhere"
        models.add_sub(outside)
        repo = base / "repo"
        repo.mkdir()
        (repo / "add_sub").symlink_to(outside / "add_sub")
        torch_saved_relu(repo, "pickled", allow_pickle=False)
        torch_saved_relu(repo, "pickled_allowed", allow_pickle=True)
        exported_linear(repo, "linear")
        sock = module_sock_dir / "mpsd.sock"
        stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stale.bind(str(sock))  # left behind without a listener, like a daemon killed with -9
        stale.close()
        config = write_daemon_config(base / "mpsd.yaml", allow_symlinks=True)
        unix = start_daemon(
            base, repo, config, f"unix://{sock}", grpcclient.InferenceServerClient(f"unix://{sock}")
        )
        started.append(unix)

        # 2. Mutual TLS and tokens (one from a file, one from the environment).
        base = tmp_path_factory.mktemp("mtls")
        repo = base / "repo"
        models.add_sub(repo)
        (base / "infer.token").write_text(INFER_TOKEN + "\n")
        (base / "reader.token").write_text(READER_TOKEN)
        for f in ("infer.token", "reader.token"):
            (base / f).chmod(0o600)
        config = write_daemon_config(
            base / "mpsd.yaml",
            tls={
                "cert_file": str(pki.server_cert),
                "key_file": str(pki.server_key),
                "client_ca_file": str(pki.ca),
            },
            auth={
                "tokens": [
                    {"token_file": "infer.token", "categories": ["inference"]},
                    {"token_file": "reader.token", "categories": ["health", "logs-statistics"]},
                    {
                        "token_env": ADMIN_ENV,
                        "categories": ["inference", "health", "model-repository", "logs-statistics"],
                    },
                ]
            },
        )
        port = free_port()
        address = f"127.0.0.1:{port}"
        mtls = start_daemon(
            base, repo, config, address, _mtls_client(address, pki), env={ADMIN_ENV: ADMIN_TOKEN}
        )
        mtls.address = address
        started.append(mtls)

        # 3. Server-only TLS on every interface, no tokens; a repository with symlinks out of it.
        base = tmp_path_factory.mktemp("tls")
        outside = base / "elsewhere"
        models.add_sub(outside, "escaped")
        models.add_sub(outside, "versioned")
        repo = base / "repo"
        repo.mkdir()
        (repo / "escaped").symlink_to(outside / "escaped")
        models.write_config(
            repo / "versioned", yaml.safe_load((outside / "versioned" / "config.yaml").read_text())
        )
        (repo / "versioned" / "1").symlink_to(outside / "versioned" / "1")
        config = write_daemon_config(
            base / "mpsd.yaml", tls={"cert_file": str(pki.server_cert), "key_file": str(pki.server_key)}
        )
        port = free_port()
        address = f"127.0.0.1:{port}"
        tls_client = grpcclient.InferenceServerClient(address, ssl=True, root_certificates=str(pki.ca))
        tls_open = start_daemon(base, repo, config, f"0.0.0.0:{port}", tls_client)
        tls_open.address = address
        started.append(tls_open)

        wait_settled(unix)
        wait_settled(mtls, bearer(ADMIN_TOKEN))
        wait_settled(tls_open)
        yield Daemons(unix, sock, mtls, pki, tls_open)
    finally:
        for daemon in started:
            daemon.stop()
            daemon.kill_group()


def status_of(call: Callable[[], object]) -> tuple[str, str]:
    """(status code, message) of a call that must fail."""
    try:
        call()
    except InferenceServerException as exc:
        return str(exc.status()), str(exc.message())
    except grpc.RpcError as exc:
        return str(exc.code()), str(exc.details())
    pytest.fail("the call was accepted")


def add_sub_inputs(value: float = 1.0) -> list[grpcclient.InferInput]:
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        inp = grpcclient.InferInput(name, [1, 16], "FP32")
        inp.set_data_from_numpy(np.full((1, 16), value, np.float32))
        inputs.append(inp)
    return inputs


def vector_input(name: str, value: np.ndarray) -> list[grpcclient.InferInput]:
    inp = grpcclient.InferInput(name, list(value.shape), "FP32")
    inp.set_data_from_numpy(value)
    return [inp]


# ---- Unix socket ----------------------------------------------------------------------------------------


def test_unix_socket_is_mode_0600_replaces_a_stale_one_and_serves(daemons: Daemons) -> None:
    st = daemons.unix_socket.stat()
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o600, oct(st.st_mode)
    assert "removing stale socket" in daemons.unix.log()
    client = daemons.unix.client
    assert client.is_server_live()
    result = client.infer("add_sub", add_sub_inputs(2.0))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.full((1, 16), 4.0, np.float32))


def test_stale_socket_check_refuses_live_sockets_and_other_files(sock_dir: Path) -> None:
    regular = sock_dir / "file.sock"
    regular.write_text("not a socket")
    with pytest.raises(ConfigError, match="not a socket"):
        remove_stale_socket(regular)
    assert regular.exists()
    live = sock_dir / "live.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(live))
        listener.listen()
        with pytest.raises(ConfigError, match="another server is listening"):
            remove_stale_socket(live)
    assert live.exists()


@pytest.mark.parametrize(
    ("address", "local"),
    [
        ("127.0.0.1:8001", True),
        ("localhost:8001", True),
        ("[::1]:8001", True),
        ("0.0.0.0:8001", False),
        ("[::]:8001", False),
        ("192.168.1.10:8001", False),
        ("unix:///run/mpsd/mpsd.sock", True),
    ],
)
def test_address_locality(address: str, local: bool) -> None:
    assert parse_address(address).is_local is local


@pytest.mark.parametrize("address", ["unix:relative.sock", "nonsense", "host:port", "unix:///" + "x" * 200])
def test_bad_addresses_are_config_errors(address: str) -> None:
    with pytest.raises(ConfigError, match="grpc_address"):
        parse_address(address)


def test_a_socket_path_of_103_bytes_is_the_longest_taken() -> None:
    """docs/security.md: macOS's sun_path holds 103 bytes and a NUL (Linux's 107), so 103 is the limit
    everywhere: a path that works on Linux is never one that a Mac refuses."""
    assert parse_address("unix:///" + "x" * 102).unix_path == Path("/" + "x" * 102)
    with pytest.raises(ConfigError, match="longer than 103 bytes"):
        parse_address("unix:///" + "x" * 103)


# ---- TLS -----------------------------------------------------------------------------------------------


def test_mutual_tls_refuses_clients_without_a_trusted_certificate(daemons: Daemons) -> None:
    pki, address = daemons.pki, daemons.mtls.address
    no_cert = grpcclient.InferenceServerClient(address, ssl=True, root_certificates=str(pki.ca))
    stranger = _mtls_client(address, pki, pki.stranger_cert, pki.stranger_key)
    plain = grpcclient.InferenceServerClient(address)
    try:
        for client in (no_cert, stranger, plain):
            code, message = status_of(lambda c=client: c.is_server_live(headers=bearer(ADMIN_TOKEN)))
            assert code == str(grpc.StatusCode.UNAVAILABLE), message
    finally:
        for client in (no_cert, stranger, plain):
            client.close()
    assert daemons.mtls.client.is_server_live(headers=bearer(ADMIN_TOKEN))


def test_server_only_tls_serves_and_refuses_plain_text(daemons: Daemons) -> None:
    assert daemons.tls_open.client.is_server_live()
    plain = grpcclient.InferenceServerClient(daemons.tls_open.address)
    try:
        code, message = status_of(plain.is_server_live)
        assert code == str(grpc.StatusCode.UNAVAILABLE), message
    finally:
        plain.close()


# ---- tokens ----------------------------------------------------------------------------------------------


def test_missing_or_wrong_token_is_unauthenticated(daemons: Daemons) -> None:
    client = daemons.mtls.client
    for headers in (None, bearer("not-a-token"), {"authorization": INFER_TOKEN}, bearer(INFER_TOKEN + "x")):
        code, message = status_of(lambda h=headers: client.infer("add_sub", add_sub_inputs(), headers=h))
        assert code == str(grpc.StatusCode.UNAUTHENTICATED), message
        assert "ModelInfer" in message and "inference" in message
    code, message = status_of(lambda: client.is_server_live())
    assert code == str(grpc.StatusCode.UNAUTHENTICATED)
    assert "authorization: Bearer" in message


def test_a_refused_call_is_answered_before_its_request_is_decoded(daemons: Daemons) -> None:
    """docs/security.md: bytes that are no ModelInferRequest get UNAUTHENTICATED without a token (they were
    never decoded), and INVALID_ARGUMENT with one."""
    pki = daemons.pki
    credentials = grpc.ssl_channel_credentials(
        pki.ca.read_bytes(), pki.client_key.read_bytes(), pki.client_cert.read_bytes()
    )
    with grpc.secure_channel(daemons.mtls.address, credentials) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")  # raw bytes both ways
        for metadata, expected in (
            (None, grpc.StatusCode.UNAUTHENTICATED),
            (list(bearer(INFER_TOKEN).items()), grpc.StatusCode.INVALID_ARGUMENT),
        ):
            with pytest.raises(grpc.RpcError) as err:
                call(b"\xff\xff\xff\xff not a message", metadata=metadata, timeout=30)
            assert err.value.code() == expected, err.value.details()


def test_each_token_opens_its_categories_only(daemons: Daemons) -> None:
    client = daemons.mtls.client
    infer, reader, admin = bearer(INFER_TOKEN), bearer(READER_TOKEN), bearer(ADMIN_TOKEN)
    result = client.infer("add_sub", add_sub_inputs(3.0), headers=infer)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.full((1, 16), 6.0, np.float32))
    denied = {
        "health": lambda: client.is_server_live(headers=infer),
        "model-repository": lambda: client.load_model("add_sub", headers=infer),
        "logs-statistics": lambda: client.get_inference_statistics(headers=infer),
        "inference": lambda: client.infer("add_sub", add_sub_inputs(), headers=reader),
    }
    for category, call in denied.items():
        code, message = status_of(call)
        assert code == str(grpc.StatusCode.PERMISSION_DENIED), message
        assert f"'{category}'" in message, message
    assert client.is_server_ready(headers=reader)
    assert client.get_inference_statistics("add_sub", headers=reader) is not None
    code, message = status_of(lambda: client.unload_model("add_sub", headers=reader))
    assert code == str(grpc.StatusCode.PERMISSION_DENIED) and "'model-repository'" in message
    client.load_model("add_sub", headers=admin)  # unchanged on disk: nothing restarts
    assert client.is_model_ready("add_sub", headers=admin)


def test_tokens_guard_streams_health_and_the_admin_service(daemons: Daemons) -> None:
    pki, address = daemons.pki, daemons.mtls.address
    credentials = grpc.ssl_channel_credentials(
        pki.ca.read_bytes(), pki.client_key.read_bytes(), pki.client_cert.read_bytes()
    )
    with grpc.secure_channel(address, credentials) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service="")
        code, _ = status_of(lambda: health.Check(request, timeout=10))
        assert code == str(grpc.StatusCode.UNAUTHENTICATED)
        reply = health.Check(request, timeout=10, metadata=tuple(bearer(READER_TOKEN).items()))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING

        list_workers = channel.unary_unary("/mpsd.v1.MpsdAdmin/ListWorkers")
        code, message = status_of(
            lambda: list_workers(b"", timeout=10, metadata=tuple(bearer(INFER_TOKEN).items()))
        )
        assert code == str(grpc.StatusCode.PERMISSION_DENIED) and "'logs-statistics'" in message
        assert isinstance(list_workers(b"", timeout=10, metadata=tuple(bearer(READER_TOKEN).items())), bytes)
        stream_logs = channel.unary_stream("/mpsd.v1.MpsdAdmin/StreamLogs")
        code, message = status_of(
            lambda: list(stream_logs(b"", timeout=10, metadata=tuple(bearer(INFER_TOKEN).items())))
        )
        assert code == str(grpc.StatusCode.PERMISSION_DENIED) and "'logs-statistics'" in message
        reload = channel.unary_unary("/mpsd.v1.MpsdAdmin/Reload")
        code, message = status_of(
            lambda: reload(b"", timeout=10, metadata=tuple(bearer(READER_TOKEN).items()))
        )
        assert code == str(grpc.StatusCode.PERMISSION_DENIED) and "'model-repository'" in message

        stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")
        request_bytes = service_pb2.ModelInferRequest(model_name="add_sub").SerializeToString()
        code, message = status_of(lambda: list(stream(iter([request_bytes]), timeout=10)))
        assert code == str(grpc.StatusCode.UNAUTHENTICATED), message


def test_every_rpc_of_the_served_services_has_a_category() -> None:
    served = {
        f"/{service.full_name}/{method.name}"
        for service in service_pb2.DESCRIPTOR.services_by_name.values()
        for method in service.methods
    }
    served |= {f"/mpsd.v1.MpsdAdmin/{m}" for m in ("StreamLogs", "ListWorkers", "Reload", "Profile")}
    served |= {"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"}
    served |= {"/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"}
    assert {m for m in served if category_of(m) is None} == set()
    assert set(METHOD_CATEGORY) >= REPOSITORY_CHANGES
    assert category_of("/inference.GRPCInferenceService/ModelInfer") == "inference"
    assert category_of("/inference.GRPCInferenceService/SystemSharedMemoryRegister") == "inference"
    assert category_of("/inference.GRPCInferenceService/ModelConfig") == "health"
    assert category_of("/inference.GRPCInferenceService/RepositoryIndex") == "model-repository"
    assert category_of("/mpsd.v1.MpsdAdmin/StreamLogs") == "logs-statistics"
    assert category_of("/mpsd.v1.MpsdAdmin/Profile") == "model-repository"


def test_open_categories_need_no_token_and_unknown_methods_are_denied() -> None:
    tokens = [Token(b"secret", frozenset({"inference"}), "test")]
    policy = AccessPolicy(tokens, open_categories=["health"])
    assert policy.check("/inference.GRPCInferenceService/ServerLive", None) is None
    refused = policy.check("/inference.GRPCInferenceService/ModelInfer", None)
    assert refused is not None and refused.code.value == "UNAUTHENTICATED"
    assert (
        policy.check("/inference.GRPCInferenceService/ModelInfer", [("authorization", "bearer secret")])
        is None
    )
    unknown = policy.check("/some.Service/Method", [("authorization", "Bearer secret")])
    assert unknown is not None and unknown.code.value == "PERMISSION_DENIED"


def test_the_gates_shortcut_answers_only_the_inference_methods_open_to_every_caller() -> None:
    """Without tokens the shortcut (grpc's own table, before the gate) hands an inference method its handler,
    unchecked, except an operator-only one reachable from the network; once SIGHUP brings tokens, only the
    open categories' methods stay in it, and the gate checks every other call's token."""
    from mpsd.daemon.api.grpc.gate import Gate, Services

    def handler(details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        return grpc.unary_unary_rpc_method_handler(lambda request, context: details.method)

    services = Services()
    services.add_generic_rpc_handlers([type("Any", (), {"service": staticmethod(handler)})()])
    gate = Gate(AccessPolicy([], repository_changes="loopback", local_only=False), services.handlers)

    def shortcut(method: str) -> object:
        found = gate.shortcut.service(
            type("Details", (), {"method": f"/inference.GRPCInferenceService/{method}"})
        )
        return found if found is None else found.unary_unary(None, None)

    assert shortcut("ModelInfer") == "/inference.GRPCInferenceService/ModelInfer"
    assert shortcut("RepositoryModelLoad") is None  # operator-only, and other hosts can reach the daemon
    gate.policy = AccessPolicy(
        [Token(b"secret", frozenset({"inference"}), "test")], open_categories=["health"]
    )
    assert shortcut("ModelInfer") is None
    assert shortcut("ServerLive") == "/inference.GRPCInferenceService/ServerLive"


def test_tokens_are_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/security.md: hmac.compare_digest over SHA-256 digests, every configured token compared on every
    call: whichever token is sent (the first, the last, none of them, a long one), each check makes one
    compare_digest per configured token, always of two 32-byte digests."""
    import hmac

    compared: list[tuple[int, int]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    tokens = [Token(f"secret-{i}".encode(), frozenset({"inference"}), f"t{i}") for i in range(3)]
    policy = AccessPolicy(tokens)
    infer = "/inference.GRPCInferenceService/ModelInfer"
    for sent, allowed in (("secret-0", True), ("secret-2", True), ("wrong", False), ("x" * 500, False)):
        compared.clear()
        outcome = policy.check(infer, [("authorization", f"Bearer {sent}")])
        assert (outcome is None) == allowed, sent
        assert compared == [(32, 32)] * len(tokens), sent


# ---- repository changes without tokens -------------------------------------------------------------------


def test_repository_changes_refused_without_token_when_reachable_from_the_network(daemons: Daemons) -> None:
    client = daemons.tls_open.client
    for call in (lambda: client.load_model("anything"), lambda: client.unload_model("anything")):
        code, message = status_of(call)
        assert code == str(grpc.StatusCode.PERMISSION_DENIED), message
        for words in (
            "0.0.0.0",
            "auth.tokens",
            "model-repository",
            "repository_changes_without_token: allow",
        ):
            assert words in message, message
    assert client.get_model_repository_index() is not None  # reading is not a change


def test_repository_changes_allowed_without_token_on_a_local_socket(daemons: Daemons) -> None:
    code, message = status_of(lambda: daemons.unix.client.load_model("not_in_repo"))
    assert code == str(grpc.StatusCode.INTERNAL), message  # allowed: Triton's answer for a model not there
    assert "failed to poll from model repository" in message, message


@pytest.mark.parametrize(
    ("policy", "local", "mutual_tls", "allowed"),
    [
        ("loopback", True, False, True),
        ("loopback", False, False, False),
        ("loopback", False, True, True),
        ("allow", False, False, True),
        ("refuse", True, False, False),
    ],
)
def test_repository_change_rule(policy: str, local: bool, mutual_tls: bool, allowed: bool) -> None:
    rule = AccessPolicy([], repository_changes=policy, local_only=local, mutual_tls=mutual_tls, address="x")
    for method in sorted(REPOSITORY_CHANGES):
        assert (rule.check(method, None) is None) is allowed, method
    assert rule.check("/inference.GRPCInferenceService/ModelInfer", None) is None


# ---- names, symlinks, pickles ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../add_sub", "..", ".", "/etc", "a/b", "a\\b", "add_sub\x00", "x.tmp"])
def test_model_names_cannot_leave_the_repository(daemons: Daemons, name: str) -> None:
    code, message = status_of(lambda: daemons.unix.client.load_model(name))
    assert code == str(grpc.StatusCode.INVALID_ARGUMENT), message


def test_symlinks_out_of_the_repository_are_refused_unless_allowed(daemons: Daemons) -> None:
    index = index_of(daemons.tls_open)
    for name, what in (("escaped", "model directory"), ("versioned", "version directory 1")):
        assert index[name]["state"] == "UNAVAILABLE", index[name]
        reason = index[name]["reason"]
        for words in (what, "outside the model repository", "allow_symlinks: true"):
            assert words in reason, reason
    assert index_of(daemons.unix)["add_sub"]["state"] == "READY"  # allow_symlinks: true there


def test_torch_save_pickle_is_refused_unless_the_model_allows_it(daemons: Daemons) -> None:
    index = index_of(daemons.unix)
    assert index["pickled"]["state"] == "UNAVAILABLE"
    for words in ("torch.save", "allow_pickle: true", "arbitrary"):
        assert words in index["pickled"]["reason"], index["pickled"]["reason"]
    assert index["pickled_allowed"]["state"] == "READY", index["pickled_allowed"]
    x = np.array([-2.0, -0.5, 0.0, 1.5], np.float32)
    result = daemons.unix.client.infer("pickled_allowed", vector_input("x", x))
    np.testing.assert_array_equal(result.as_numpy("y"), np.maximum(x, 0))


def test_exported_program_loads_without_unpickling(daemons: Daemons) -> None:
    x = np.array([1.0, 2.0, -1.0, 0.5], np.float32)
    result = daemons.unix.client.infer("linear", vector_input("x", x))
    np.testing.assert_allclose(result.as_numpy("y"), LINEAR_WEIGHT @ x + LINEAR_BIAS, rtol=1e-6)
    # docs/api.md: ModelMetadata's platform names the backend
    assert daemons.unix.client.get_model_metadata("linear", as_json=True)["platform"] == "torch_export"


def test_archive_kinds_and_the_unpickling_guard(tmp_path: Path) -> None:
    module = nn.Sequential(nn.ReLU())
    torch.jit.save(torch.jit.script(module), str(tmp_path / "script.pt"))
    torch.save(module, tmp_path / "saved.pt")
    torch.save(module, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    (tmp_path / "junk.pt").write_bytes(b"junk")
    kinds = {p.name: archive_kind(str(p)) for p in sorted(tmp_path.iterdir())}
    assert kinds == {
        "junk.pt": "unknown",
        "legacy.pt": "pickle",
        "saved.pt": "torch.save",
        "script.pt": "torchscript",
    }

    with no_unpickling(str(tmp_path / "saved.pt")):
        with pytest.raises(PickleRefused, match="allow_pickle"):
            pickle.loads(pickle.dumps(module))
        with pytest.raises(PickleRefused, match="allow_pickle"):
            torch.load(tmp_path / "saved.pt", weights_only=False)
    assert isinstance(pickle.loads(pickle.dumps([1, 2])), list)  # restored afterwards
    assert isinstance(torch.load(tmp_path / "saved.pt", weights_only=False), nn.Sequential)


# ---- configuration ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ({"auth": {"tokens": [{"token": "inline", "categories": ["health"]}]}}, "token_file or token_env"),
        (
            {"auth": {"tokens": [{"token_env": "A", "token_file": "b", "categories": ["health"]}]}},
            "exactly one",
        ),
        (
            {"auth": {"tokens": [{"token_env": "MPSD_TEST_UNSET_VAR", "categories": ["health"]}]}},
            "is not set",
        ),
        ({"auth": {"tokens": [{"token_env": "HOME", "categories": ["everything"]}]}}, "categories"),
        ({"auth": {"tokens": [{"token_file": "missing.token", "categories": ["health"]}]}}, "missing.token"),
        ({"tls": {"cert_file": "nope.pem", "key_file": "nope.key"}}, "tls.cert_file"),
    ],
)
def test_security_config_errors_name_the_field(tmp_path: Path, settings: dict[str, Any], words: str) -> None:
    path = write_daemon_config(tmp_path / "mpsd.yaml", **settings)
    with pytest.raises(ConfigError, match=words):
        load_daemon_config(path)


def test_unreadable_token_stops_the_daemon_before_it_starts(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    config = write_daemon_config(
        tmp_path / "mpsd.yaml",
        auth={"tokens": [{"token_env": "MPSD_TEST_UNSET_VAR", "categories": ["inference"]}]},
    )
    env = {k: v for k, v in os.environ.items() if k != "MPSD_TEST_UNSET_VAR"}
    proc = subprocess.run(
        [sys.executable, "-m", "mpsd", "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 78, proc.stderr
    assert "MPSD_TEST_UNSET_VAR is not set" in proc.stderr


def test_auth_config_defaults_to_the_loopback_rule() -> None:
    assert AuthConfig().repository_changes_without_token == "loopback"
    assert AuthConfig().tokens == []


def client_tls_args(daemons: Daemons) -> list[str]:
    """The tools' options to reach the mutual-TLS daemon with the test client certificate."""
    pki = daemons.pki
    return [
        "--address",
        daemons.mtls.address,
        "--tls-ca",
        str(pki.ca),
        "--tls-cert",
        str(pki.client_cert),
        "--tls-key",
        str(pki.client_key),
    ]


def test_command_line_tools_speak_mutual_tls_and_tokens(daemons: Daemons, tmp_path: Path) -> None:
    """`mpsd models` / `mpsd infer` with --tls-* and a token; refused without the token, one line."""
    token = tmp_path / "admin.token"
    token.write_text(ADMIN_TOKEN)
    tls = client_tls_args(daemons)
    cli = [sys.executable, "-m", "mpsd"]
    env = {k: v for k, v in os.environ.items() if k != "MPSD_TOKEN"}
    listed = subprocess.run(
        [*cli, "models", *tls, "--token-file", str(token)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert listed.returncode == 0, listed.stderr
    assert "add_sub" in listed.stdout and "READY" in listed.stdout
    answered = subprocess.run(
        [
            *cli,
            "infer",
            "add_sub",
            "--input",
            "INPUT0=1",
            "--input",
            "INPUT1=2",
            "--output-format",
            "json",
            *tls,
        ],
        capture_output=True,
        text=True,
        env={**env, "MPSD_TOKEN": ADMIN_TOKEN},
        timeout=60,
    )
    assert answered.returncode == 0, answered.stderr
    assert "3.0" in answered.stdout
    refused = subprocess.run([*cli, "models", *tls], capture_output=True, text=True, env=env, timeout=60)
    assert refused.returncode != 0
    assert "UNAUTHENTICATED" in refused.stderr and "--token-file" in refused.stderr
    assert "Traceback" not in refused.stderr
    narrow = subprocess.run(
        [*cli, "infer", "add_sub", "--input", "INPUT0=1", "--input", "INPUT1=2", *tls],
        capture_output=True,
        text=True,
        env={**env, "MPSD_TOKEN": INFER_TOKEN},
        timeout=60,
    )
    assert narrow.returncode != 0
    assert "PERMISSION_DENIED" in narrow.stderr and "'health'" in narrow.stderr


def test_the_service_installers_health_probe_speaks_mutual_tls_and_tokens(
    daemons: Daemons, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`mpsd service install/start` wait for Health/Check; a daemon with mutual TLS and tokens answers it
    only with a client certificate and a token, which the service commands take as the other tools do."""
    import argparse

    from mpsd.cli import build_parser
    from mpsd.service.health import check_once

    monkeypatch.delenv("MPSD_TOKEN", raising=False)
    pki = daemons.pki
    token = tmp_path / "admin.token"
    token.write_text(ADMIN_TOKEN)
    tls = {"tls_ca": pki.ca, "tls_cert": pki.client_cert, "tls_key": pki.client_key}
    address = daemons.mtls.address
    assert check_once(address, 10, argparse.Namespace(**tls, token_file=token)) == "SERVING"
    assert check_once(address, 10, argparse.Namespace(**tls, token_file=None)) == "UNAUTHENTICATED"
    assert check_once(address, 10) != "SERVING"  # plaintext to a TLS port

    argv = ["service", "start", *client_tls_args(daemons), "--token-file", str(token)]
    args = build_parser().parse_args(argv)
    assert check_once(args.address, 10, args) == "SERVING"


def _events(daemon: RunningDaemon, event: str) -> list[dict[str, Any]]:
    import json

    found = []
    for line in daemon.log().splitlines():
        if line.startswith("{") and f'"{event}"' in line:
            found.append(json.loads(line))
    return [e for e in found if e.get("event") == event]


@pytest.mark.parametrize("fronts", [0, pytest.param(1, marks=shared_port_fronts())])
def test_sighup_rereads_the_token_files_here_and_in_the_fronts(tmp_path: Path, fronts: int) -> None:
    """A token rotated in its file takes effect at SIGHUP, without a restart; one that cannot be read then
    leaves the previous token in force."""
    import signal

    repo = tmp_path / "repo"
    models.add_sub(repo)
    token = tmp_path / "rotating.token"
    token.write_text("first-token\n")
    token.chmod(0o600)
    config = write_daemon_config(
        tmp_path / "mpsd.yaml",
        front_processes=fronts,
        auth={
            "tokens": [{"token_file": "rotating.token", "categories": ["inference"]}],
            "open_categories": ["health"],
        },
    )
    daemon = RunningDaemon(repo, tmp_path / "daemon.log", config=config)
    try:
        daemon.wait_ready()

        def infer(secret: str) -> object:
            return daemon.client.infer("add_sub", add_sub_inputs(), headers=bearer(secret))

        infer("first-token")
        token.write_text("second-token\n")
        os.kill(daemon.pid, signal.SIGHUP)
        wait_for(lambda: len(_events(daemon, "tokens reloaded")) == 1 + fronts, 30, "tokens reloaded")
        code, _ = status_of(lambda: infer("first-token"))
        assert code == str(grpc.StatusCode.UNAUTHENTICATED)
        infer("second-token")

        token.write_text("")  # unreadable as a token: the second one stays in force
        os.kill(daemon.pid, signal.SIGHUP)
        wait_for(lambda: _events(daemon, "config not reloaded"), 30, "config not reloaded")
        assert "holds an empty token" in _events(daemon, "config not reloaded")[0]["reason"]
        infer("second-token")
        assert len(_events(daemon, "tokens reloaded")) == 1 + fronts
    finally:
        daemon.stop()
        daemon.kill_group()


def test_tokens_reach_the_fronts_as_the_daemon_read_them() -> None:
    from mpsd.net.auth import export_tokens, import_tokens

    tokens = [Token(b"s3cret", frozenset({"inference", "health"}), "token_file /etc/t", True)]
    back = import_tokens(yaml.safe_load(yaml.safe_dump(export_tokens(tokens))))
    (token,) = back
    assert (token.secret, token.source) == (b"s3cret", "token_file /etc/t")
    assert token.categories == {"inference", "health"}
    assert not token.group_readable_file  # the daemon warned about the file already


def _tls_live(address: str, ca: Path) -> tuple[str, str]:
    """('ok', '') when a fresh TLS connection trusting `ca` is served, else the status and message."""
    client = grpcclient.InferenceServerClient(address, ssl=True, root_certificates=str(ca))
    try:
        client.is_server_live()
    except InferenceServerException as exc:
        return str(exc.status()), str(exc.message())
    finally:
        client.close()
    return "ok", ""


@pytest.mark.parametrize("fronts", [0, pytest.param(1, marks=shared_port_fronts())])
def test_sighup_serves_a_renewed_certificate_here_and_in_the_fronts(tmp_path: Path, fronts: int) -> None:
    """A certificate renewed on disk is served to new connections after SIGHUP, without a restart; one
    that cannot be read, or a reload that would turn client certificates on, changes nothing."""
    import shutil
    import signal

    for name in ("old", "new", "live"):
        (tmp_path / name).mkdir()
    old, new, live = make_pki(tmp_path / "old"), make_pki(tmp_path / "new"), tmp_path / "live"
    shutil.copy(old.server_cert, live / "server.pem")
    shutil.copy(old.server_key, live / "server.key")
    repo = tmp_path / "repo"
    models.add_sub(repo)
    tls = {"cert_file": "live/server.pem", "key_file": "live/server.key"}
    config = write_daemon_config(tmp_path / "mpsd.yaml", front_processes=fronts, tls=tls)
    address = f"localhost:{free_port()}"
    client = grpcclient.InferenceServerClient(address, ssl=True, root_certificates=str(old.ca))
    daemon = start_daemon(tmp_path, repo, config, address, client)
    try:
        wait_for(lambda: _tls_live(address, old.ca)[0] == "ok", 60, f"served over TLS\n{daemon.log()}")
        assert _tls_live(address, new.ca)[0] == str(grpc.StatusCode.UNAVAILABLE)
        assert client.is_server_live()  # its connection is open from here on

        shutil.copy(new.server_cert, live / "server.pem")
        shutil.copy(new.server_key, live / "server.key")
        os.kill(daemon.pid, signal.SIGHUP)
        reloaded = lambda: len(_events(daemon, "certificates reloaded")) == 1 + fronts  # noqa: E731
        wait_for(reloaded, 30, f"certificates reloaded\n{daemon.log()}")
        assert _tls_live(address, new.ca) == ("ok", "")
        assert _tls_live(address, old.ca)[0] == str(grpc.StatusCode.UNAVAILABLE)
        assert client.is_server_live(), "a connection opened before the reload keeps its session"

        (live / "server.key").write_text("")  # unreadable as a key file: the new certificate stays
        os.kill(daemon.pid, signal.SIGHUP)
        wait_for(lambda: _events(daemon, "config not reloaded"), 30, "config not reloaded")
        assert "tls.key_file" in _events(daemon, "config not reloaded")[0]["reason"]
        assert _tls_live(address, new.ca) == ("ok", "")

        shutil.copy(new.server_key, live / "server.key")
        write_daemon_config(
            tmp_path / "mpsd.yaml", front_processes=fronts, tls={**tls, "client_ca_file": str(new.ca)}
        )
        os.kill(daemon.pid, signal.SIGHUP)
        wait_for(lambda: len(_events(daemon, "config not reloaded")) == 2, 30, "config not reloaded")
        assert "takes a restart" in _events(daemon, "config not reloaded")[1]["reason"]
        assert _tls_live(address, new.ca) == ("ok", ""), "client certificates are still not required"
        assert len(_events(daemon, "certificates reloaded")) == 1 + fronts
    finally:
        daemon.stop()
        daemon.kill_group()


def test_certificates_that_cannot_be_served_are_config_errors(tmp_path: Path) -> None:
    """Checked when read (start or SIGHUP), not at a client's first handshake; each message names the file."""
    from mpsd.config.security import TlsConfig
    from mpsd.net.certificates import TlsMaterial

    pki = make_pki(tmp_path)
    good = TlsMaterial.read(
        TlsConfig(cert_file=pki.server_cert, key_file=pki.server_key, client_ca_file=pki.ca)
    )
    assert good.mutual and TlsMaterial.load(yaml.safe_load(yaml.safe_dump(good.export()))) == good
    assert "PRIVATE KEY" not in repr(good) and "CERTIFICATE" in repr(good)

    def refused(cert: Path, key: Path, ca: Path | None = None) -> str:
        with pytest.raises(ConfigError) as info:
            TlsMaterial.read(TlsConfig(cert_file=cert, key_file=key, client_ca_file=ca))
        return info.value.message

    assert refused(pki.server_cert, pki.client_key).startswith("tls.key_file: ")
    assert "KEY_VALUES_MISMATCH" in refused(pki.server_cert, pki.client_key)
    empty = tmp_path / "empty.pem"
    empty.write_text("")
    assert refused(empty, pki.server_key).startswith(
        f"tls.cert_file: {empty} holds no usable PEM certificate"
    )
    assert refused(pki.server_cert, empty).startswith(f"tls.key_file: {empty} cannot be served with")
    junk = tmp_path / "junk.pem"
    junk.write_text("-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")
    assert refused(pki.server_cert, pki.server_key, junk).startswith(f"tls.client_ca_file: {junk} holds no")
    key = serialization.load_pem_private_key(pki.server_key.read_bytes(), None)
    encrypted = tmp_path / "encrypted.key"
    encrypted.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"pass"),
        )
    )
    assert refused(pki.server_cert, encrypted) == (
        f"tls.key_file: {encrypted} is encrypted; gRPC needs an unencrypted key"
    )
