"""Malformed HTTP infer requests, sent as bytes: each gets a clear 4xx with Triton's `{"error": ...}` body,
never a crash, and no shared-memory region stays held by a request that failed."""

from __future__ import annotations

import gzip
import http.client
import json
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
import yaml
from tritonclient.utils import InferenceServerException

from tests import models
from tests.conftest import RunningDaemon, http_request, serving
from tests.os_skips import linux_only
from tests.triton_shm import shm

INFER = "/v2/models/add_sub/infer"
ROW = np.ones(16, np.float32).tobytes()  # one FP32 row of add_sub
LIMIT = 1 << 20  # max_message_bytes of the daemon below


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    base = tmp_path_factory.mktemp("http_bad")
    models.add_sub(base / "repo")  # INPUT0/INPUT1 FP32 [16], max_batch_size 8
    config = base / "mpsd.yaml"
    config.write_text(
        yaml.safe_dump({"max_message_bytes": LIMIT, "metrics_address": "", "server_name": "triton"})
    )
    with serving(base / "repo", base / "daemon.log", config=config) as d:
        d.pids = sorted(d.worker_pids())  # type: ignore[attr-defined]
        yield d


def header(inputs: list[dict[str, object]], **extra: object) -> bytes:
    return json.dumps({"inputs": inputs, **extra}).encode()


def binary_input(name: str, size: int = len(ROW)) -> dict[str, object]:
    return {"name": name, "shape": [1, 16], "datatype": "FP32", "parameters": {"binary_data_size": size}}


def binary_request(
    json_part: bytes, data: bytes, length: int | str | None = None
) -> tuple[bytes, dict[str, str]]:
    value = str(len(json_part) if length is None else length)
    return json_part + data, {"Inference-Header-Content-Length": value}


def valid() -> tuple[bytes, dict[str, str]]:
    return binary_request(header([binary_input("INPUT0"), binary_input("INPUT1")]), ROW + ROW)


def send(daemon: RunningDaemon, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, str]:
    status, reply, raw = http_request(daemon.http_address, "POST", INFER, body, headers)
    if status == 200:
        return status, ""
    assert reply is not None and set(reply) == {"error"}, raw[:500]
    return status, str(reply["error"])


JSON_ROW = {"name": "INPUT1", "shape": [1, 16], "datatype": "FP32", "data": [1.0] * 16}
CASES: list[tuple[str, bytes, dict[str, str], int, str]] = [
    ("malformed JSON", b'{"inputs": [', {}, 400, "not valid JSON"),
    ("not an object", b"[1, 2]", {}, 400, "must be a JSON object"),
    ("not UTF-8", b'{"id": "\xff\xfe", "inputs": []}', {}, 400, "not UTF-8"),
    ("empty body", b"", {}, 400, "not valid JSON"),
    ("unknown field", header([], model="x"), {}, 400, "unknown field(s) 'model'"),
    ("inputs not an array", b'{"inputs": {}}', {}, 400, "'inputs' must be an array"),
    ("shape of strings", header([{**JSON_ROW, "shape": ["1", "16"]}]), {}, 400, "'shape' must be an array"),
    ("shape beyond 64 bits", header([{**JSON_ROW, "shape": [2**70]}]), {}, 400, "64 bits"),
    ("data not an array", header([{**JSON_ROW, "data": 3}]), {}, 400, "'data' must be an array"),
    ("no data at all", header([{k: v for k, v in JSON_ROW.items() if k != "data"}]), {}, 400, "exactly one"),
    (
        "data and binary both",
        header([{**JSON_ROW, "parameters": {"binary_data_size": 64}}]),
        {},
        400,
        "exactly one",
    ),
    ("JSON data of strings", header([{**JSON_ROW, "data": ["1"] * 16}]), {}, 400, "must be numbers"),
    (
        "JSON data of booleans",
        header([{**JSON_ROW, "data": [True] * 16}]),
        {},
        400,
        "must be numbers, got bool",
    ),
    ("JSON data count", header([{**JSON_ROW, "data": [1.0] * 15}]), {}, 400, "15 elements, expected 16"),
    ("header length not a number", valid()[0], {"Inference-Header-Content-Length": "ten"}, 400, "byte count"),
    ("header length zero", valid()[0], {"Inference-Header-Content-Length": "0"}, 400, "needs its JSON"),
    ("header length past the body", *binary_request(b"{}", b"", 10**12), 400, "has only"),
    ("header length cuts the JSON", *binary_request(header([binary_input("INPUT0")]), ROW, 10), 400, "JSON"),
    (
        "binary data short",
        *binary_request(header([binary_input("INPUT0"), binary_input("INPUT1")]), ROW + ROW[:10]),
        400,
        "bytes of binary data are left",
    ),
    (
        "binary data too long",
        *binary_request(header([binary_input("INPUT0"), binary_input("INPUT1")]), ROW + ROW + b"xx"),
        400,
        "2 bytes after",
    ),
    (
        "binary size negative",
        *binary_request(header([binary_input("INPUT0", -1), binary_input("INPUT1")]), ROW + ROW),
        400,
        "non-negative",
    ),
    (
        "wrong byte count",
        *binary_request(header([binary_input("INPUT0", 60), binary_input("INPUT1", 68)]), ROW + ROW),
        400,
        "raw content has 60 bytes, expected 64",
    ),
    (
        "huge binary size",
        *binary_request(header([binary_input("INPUT0", 2**62), binary_input("INPUT1")]), ROW + ROW),
        400,
        "bytes of binary data are left",
    ),
    (
        "huge shape",
        *binary_request(
            header([{**binary_input("INPUT0"), "shape": [2**62, 2**62]}, binary_input("INPUT1")]), ROW + ROW
        ),
        400,
        "overflows 64 bits",
    ),
    ("parameter of null", header([JSON_ROW], parameters={"priority": None}), {}, 400, "boolean, a number"),
    ("unknown parameter", header([JSON_ROW], parameters={"colour": "red"}), {}, 400, "unknown parameter"),
    (
        "binary_data not a boolean",
        header([JSON_ROW], outputs=[{"name": "OUTPUT0", "parameters": {"binary_data": 1}}]),
        {},
        400,
        "must be a boolean",
    ),
    ("lone surrogate", b'{"id": "\\ud800", "inputs": []}', {}, 400, ""),
    (
        "integer too large for any float",
        b'{"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": '
        + b"[1"
        + b"0" * 400
        + b", 1" * 15
        + b"]}]}",
        {},
        400,
        "too large for FP32",
    ),
]


@pytest.mark.parametrize(
    ("body", "headers", "status", "words"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_malformed_bodies_get_a_clear_4xx(
    daemon: RunningDaemon, body: bytes, headers: dict[str, str], status: int, words: str
) -> None:
    got, message = send(daemon, body, headers)
    assert (got, words in message) == (status, True), message


def test_integers_are_numbers_for_float_inputs(daemon: RunningDaemon) -> None:
    body = header([{**JSON_ROW, "name": "INPUT0", "data": [[1] * 16]}, JSON_ROW])  # nested, as KServe allows
    assert send(daemon, body) == (200, "")


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_a_compressed_request_is_inflated_and_served(daemon: RunningDaemon, algorithm: str) -> None:
    """tritonclient.http compresses a request when asked (Content-Encoding), as Triton accepts."""
    client = httpclient.InferenceServerClient(daemon.http_address)
    try:
        inputs = []
        for name in ("INPUT0", "INPUT1"):
            inp = httpclient.InferInput(name, [1, 16], "FP32")
            inp.set_data_from_numpy(np.full((1, 16), 2.0, np.float32), binary_data=True)
            inputs.append(inp)
        result = client.infer("add_sub", inputs, request_compression_algorithm=algorithm)
        assert result.as_numpy("OUTPUT0").tolist() == [[4.0] * 16]
    finally:
        client.close()


def test_a_shared_memory_key_that_is_no_text_is_refused(daemon: RunningDaemon) -> None:
    body = b'{"key": "\\ud800", "byte_size": 16}'
    status, reply, raw = http_request(
        daemon.http_address, "POST", "/v2/systemsharedmemory/region/odd/register", body
    )
    assert status == 400 and "not valid text" in reply["error"], raw[:300]


def test_a_valid_request_still_works_and_nothing_crashed(daemon: RunningDaemon) -> None:
    status, _, raw = http_request(daemon.http_address, "POST", INFER, *valid())
    assert status == 200, raw[:300]
    assert sorted(daemon.worker_pids()) == daemon.pids  # type: ignore[attr-defined]
    log = daemon.log()
    assert "unexpected error" not in log and "Traceback" not in log, log[-3000:]


def test_an_oversized_body_is_refused_with_413(daemon: RunningDaemon) -> None:
    """The stock client sends it whole; the daemon answers from the declared length, reading none of it
    into memory, and discards the rest."""
    client = httpclient.InferenceServerClient(daemon.http_address, network_timeout=60)
    try:
        big = np.ones((8, LIMIT // 64), np.float32)  # 2 x 1 MiB
        inputs = [httpclient.InferInput(n, list(big.shape), "FP32") for n in ("INPUT0", "INPUT1")]
        for inp in inputs:
            inp.set_data_from_numpy(big)
        with pytest.raises(httpclient.InferenceServerException) as err:
            client.infer("add_sub", inputs)
        assert err.value.status() == "413"
        assert "max_message_bytes" in err.value.message()
    finally:
        client.close()


def test_a_body_over_the_limit_once_inflated_is_refused_with_413(daemon: RunningDaemon) -> None:
    """A gzip body declares its compressed length, 2 KiB, far under the limit: what counts is the body as
    inflated, 2 MiB, so it is refused as it is read."""
    body = gzip.compress(bytes(2 * LIMIT))
    status, message = send(daemon, body, {"Content-Encoding": "gzip"})
    assert status == 413 and "max_message_bytes" in message, (status, message)


def test_a_chunked_body_over_the_limit_is_refused_with_413(daemon: RunningDaemon) -> None:
    """A chunked body declares no length at all: it is counted as it is read, and refused past the limit."""
    chunk = bytes(1 << 16)
    host, _, port = daemon.http_address.rpartition(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:  # an iterable body is sent chunked
        connection.request("POST", INFER, body=(chunk for _ in range(LIMIT // len(chunk) + 1)))
        response = connection.getresponse()
        status, reply = response.status, json.loads(response.read())
    finally:
        connection.close()
    assert status == 413 and "max_message_bytes" in reply["error"], (status, reply)


def test_a_huge_declared_length_is_refused_before_any_body(daemon: RunningDaemon) -> None:
    host, _, port = daemon.http_address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Length: {10**15}\r\n\r\n".encode()
        )  # and no body at all
        reply = sock.recv(65536).decode("latin-1")
    assert reply.startswith("HTTP/1.1 413"), reply
    assert '"error"' in reply and "max_message_bytes" in reply


def test_a_truncated_body_with_the_connection_closed_harms_nothing(daemon: RunningDaemon) -> None:
    body, headers = valid()
    host, _, port = daemon.http_address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        sock.sendall(
            f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{head}\r\n".encode()
        )
        sock.sendall(body[: len(body) // 2])
    assert http_request(daemon.http_address, "POST", INFER, *valid())[0] == 200


def _held(key: str, pid: int) -> bool:
    """Whether process `pid` holds a descriptor of the shared-memory object `key`."""
    fds = Path(f"/proc/{pid}/fd")
    return any(os.path.realpath(p).endswith(key) for p in fds.iterdir()) if fds.is_dir() else False


@linux_only("reads the descriptors the daemon holds in /proc/PID/fd")
def test_failed_requests_leave_no_shared_memory_region_held(daemon: RunningDaemon) -> None:
    key = f"/mpsdtest_http_{os.getpid()}"
    handle = shm.create_shared_memory_region("bad_http", key, 256)
    client = httpclient.InferenceServerClient(daemon.http_address)
    try:
        shm.set_shared_memory_region(handle, [np.ones(16, np.float32), np.ones(16, np.float32)])
        client.register_system_shared_memory("bad_http", key, 256)
        assert _held(key, daemon.pid)
        region = {"shared_memory_region": "bad_http", "shared_memory_byte_size": 64}
        in_region = {"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "parameters": region}
        past_the_end = {**region, "shared_memory_offset": 250}
        for body in (  # each fails after INPUT0 has taken the region
            header([in_region, {**JSON_ROW, "data": [1.0] * 3}]),
            header([in_region, JSON_ROW], outputs=[{"name": "OUTPUT0", "parameters": past_the_end}]),
            header([in_region, JSON_ROW], outputs=[{"name": "nope"}]),
        ):  # fmt: skip
            assert send(daemon, body)[0] == 400
        ok = header(
            [in_region, JSON_ROW],
            outputs=[{"name": "OUTPUT0", "parameters": {**region, "shared_memory_offset": 64}}],
        )
        assert send(daemon, ok)[0] == 200
        out = shm.get_contents_as_numpy(handle, np.float32, [16], offset=64)
        np.testing.assert_array_equal(out, np.full(16, 2.0, np.float32))
        client.unregister_system_shared_memory("bad_http")
        assert not _held(key, daemon.pid)
    finally:
        client.close()
        shm.destroy_shared_memory_region(handle)


# ---- Triton's answers, word for word, where its clients and examples match them -----------------------

UNKNOWN = "Request for unknown model: 'no_such_model' is not found"


@pytest.fixture(scope="module")
def client(daemon: RunningDaemon) -> Iterator[httpclient.InferenceServerClient]:
    c = httpclient.InferenceServerClient(daemon.http_address)
    try:
        yield c
    finally:
        c.close()


def failure(call: Callable[[], object]) -> tuple[str, str]:
    """(HTTP status, message) of a stock client call that must fail."""
    try:
        call()
    except InferenceServerException as exc:
        return str(exc.status()), str(exc.message())
    pytest.fail("the call succeeded")


def pair() -> list[httpclient.InferInput]:
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        inp = httpclient.InferInput(name, [1, 16], "FP32")
        inp.set_data_from_numpy(np.ones((1, 16), np.float32))
        inputs.append(inp)
    return inputs


def test_the_server_name_is_the_configured_one_on_both_protocols(
    daemon: RunningDaemon, client: httpclient.InferenceServerClient
) -> None:
    """`server_name: triton`, for clients that check for Triton's name (as Triton's own examples do)."""
    assert client.get_server_metadata()["name"] == "triton"
    assert daemon.client.get_server_metadata().name == "triton"


def test_an_unknown_model_is_answered_as_triton_answers(client: httpclient.InferenceServerClient) -> None:
    for what, call in {
        "infer": lambda: client.infer("no_such_model", pair()),
        "metadata": lambda: client.get_model_metadata("no_such_model"),
        "config": lambda: client.get_model_config("no_such_model"),
    }.items():
        assert failure(call) == ("404", UNKNOWN), what
    assert failure(lambda: client.get_inference_statistics("no_such_model")) == (
        "400",
        "requested model 'no_such_model' is not available",
    )
    assert client.is_model_ready("no_such_model") is False


HTTP_VERSIONS = [
    ("7", "404", "Request for unknown model: 'add_sub' version 7 is not found"),
    ("abc", "404", "Not Found"),
    ("-1", "404", "Not Found"),
    (
        "99999999999999999999",
        "400",
        "failed to get model version from specified version string '99999999999999999999' "
        "(details: stol), version should be an integral value > 0",
    ),
]


@pytest.mark.parametrize(("version", "status", "message"), HTTP_VERSIONS, ids=[v[0] for v in HTTP_VERSIONS])
def test_versions_are_read_and_refused_as_triton_does(
    client: httpclient.InferenceServerClient, version: str, status: str, message: str
) -> None:
    """A version in a path is a number, as in Triton's routes: any other path is 404 `Not Found`; a
    number the model has no version of is Triton's unknown model, one past a 64-bit long its bad version."""
    for what, call in {
        "infer": lambda: client.infer("add_sub", pair(), model_version=version),
        "metadata": lambda: client.get_model_metadata("add_sub", version),
        "config": lambda: client.get_model_config("add_sub", version),
    }.items():
        assert failure(call) == (status, message), what
    assert client.is_model_ready("add_sub", version) is False
    if version == "7":
        assert failure(lambda: client.get_inference_statistics("add_sub", version)) == (
            "400",
            "requested model version is not available for model 'add_sub'",
        )
