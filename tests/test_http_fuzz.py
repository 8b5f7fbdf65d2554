"""Random malformed HTTP infer requests through the real daemon (hypothesis), as tests/test_fuzz.py does
for gRPC.

Every request ends in a clean status (200 or a 4xx with Triton's `{"error": ...}` body, never a 5xx, never a
hang), the daemon and its workers stay up with the same pids, nothing unexpected is logged, and a valid
request afterwards succeeds. `MPSD_FUZZ_EXAMPLES` and `MPSD_FUZZ_SEED` work as for the gRPC fuzz test.
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests import models
from tests.conftest import RunningDaemon, http_request
from tests.test_fuzz import DATATYPES, PARAMETER_NAMES, fuzz, names

CLEAN = {200, 400, 404, 413, 501}
HEADER = "Inference-Header-Content-Length"


@dataclass
class Fuzzed:
    daemon: RunningDaemon
    pids: list[int]


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fuzzed]:
    base = tmp_path_factory.mktemp("http_fuzz")
    repo = base / "repo"
    models.add_sub(repo)  # INPUT0/INPUT1 FP32 [16], max_batch_size 8
    models.identity(repo, "vec", "TYPE_INT32", [-1])  # variable length, no batch dimension
    d = RunningDaemon(repo, base / "daemon.log", extra_args=["--metrics-address", ""])
    try:
        d.wait_ready()
        pids = sorted(d.worker_pids())
        assert len(pids) == 2
        yield Fuzzed(d, pids)
    finally:
        d.stop()
        d.kill_group()


# ---- a request: the JSON header as a dict, the binary part, the model in the path --------------------------


@dataclass
class Request:
    model: str
    head: dict[str, Any]
    binary: bytes
    header_length: str | None = "auto"  # "auto": the JSON's length when there is binary data

    def encode(self, ensure_ascii: bool) -> tuple[str, bytes, dict[str, str]]:
        text = json.dumps(self.head, ensure_ascii=ensure_ascii).encode("utf-8", "surrogatepass")
        headers = {}
        length = str(len(text)) if self.header_length == "auto" else self.header_length
        if length is not None and (self.binary or self.header_length != "auto"):
            headers[HEADER] = length
        path = f"/v2/models/{urllib.parse.quote(self.model, safe='')}/infer"
        return path, text + self.binary, headers


def valid_request(model: str, binary: bool) -> Request:
    if model == "add_sub":
        if binary:
            row = np.ones((2, 16), np.float32).tobytes()
            inputs = [
                {
                    "name": n,
                    "shape": [2, 16],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": len(row)},
                }
                for n in ("INPUT0", "INPUT1")
            ]
            return Request(model, {"id": "fuzz", "inputs": inputs}, row + row)
        inputs = [
            {"name": n, "shape": [2, 16], "datatype": "FP32", "data": [1.0] * 32}
            for n in ("INPUT0", "INPUT1")
        ]
        return Request(model, {"id": "fuzz", "inputs": inputs}, b"")
    return Request(
        model, {"inputs": [{"name": "IN", "shape": [5], "datatype": "INT32", "data": [1, 2, 3, 4, 5]}]}, b""
    )


json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**65), 2**65),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=20,
)
dims = st.one_of(st.integers(-3, 20), st.sampled_from([0, 16, 2**31, 2**62, 2**63 - 1, 2**64, -(2**63)]))
keys = st.one_of(st.sampled_from(PARAMETER_NAMES), st.text(max_size=20))


def _pick_input(draw: st.DrawFn, r: Request) -> dict[str, Any] | None:
    inputs = r.head.get("inputs")
    if not isinstance(inputs, list) or not inputs or not isinstance(inputs[0], dict):
        return None
    item = inputs[draw(st.integers(0, len(inputs) - 1))]
    return item if isinstance(item, dict) else None


def m_model(draw: st.DrawFn, r: Request) -> None:
    r.model = draw(names)


def m_top_field(draw: st.DrawFn, r: Request) -> None:
    r.head[draw(st.sampled_from(["id", "parameters", "inputs", "outputs", "model", ""]))] = draw(json_values)


def m_request_parameter(draw: st.DrawFn, r: Request) -> None:
    params = r.head.setdefault("parameters", {})
    if isinstance(params, dict):
        params[draw(keys)] = draw(json_scalars)


def m_input_field(draw: st.DrawFn, r: Request) -> None:
    if (t := _pick_input(draw, r)) is not None:
        field = draw(st.sampled_from(["name", "datatype", "shape", "data", "parameters", "extra"]))
        t[field] = draw(json_values)


def m_input_name(draw: st.DrawFn, r: Request) -> None:
    if (t := _pick_input(draw, r)) is not None:
        t["name"] = draw(names)


def m_datatype(draw: st.DrawFn, r: Request) -> None:
    if (t := _pick_input(draw, r)) is not None:
        t["datatype"] = draw(st.one_of(st.sampled_from(DATATYPES), st.text(max_size=10)))


def m_shape(draw: st.DrawFn, r: Request) -> None:
    if (t := _pick_input(draw, r)) is not None:
        t["shape"] = draw(st.lists(dims, max_size=18))


def m_data(draw: st.DrawFn, r: Request) -> None:
    if (t := _pick_input(draw, r)) is not None:
        element = st.one_of(st.integers(-(2**70), 2**70), st.floats(), st.booleans(), json_scalars)
        rows = st.lists(st.lists(element, max_size=5), max_size=5)
        data = draw(st.one_of(st.lists(element, max_size=40), rows))
        t["data"] = data
        if draw(st.booleans()):  # a shape that agrees, so that the elements themselves are looked at
            t["shape"] = [sum(len(d) if isinstance(d, list) else 1 for d in data)]


def m_tensor_parameter(draw: st.DrawFn, r: Request) -> None:
    if (t := _pick_input(draw, r)) is not None:
        params = t.setdefault("parameters", {})
        if isinstance(params, dict):
            value = draw(st.one_of(json_scalars, st.integers(0, 300), st.just("region")))
            params[draw(keys)] = value


def m_binary(draw: st.DrawFn, r: Request) -> None:
    r.binary = draw(st.one_of(st.binary(max_size=200), st.just(r.binary[: len(r.binary) // 2])))


def m_header_length(draw: st.DrawFn, r: Request) -> None:
    r.header_length = draw(
        st.one_of(
            st.none(),
            st.integers(-5, 10**20).map(str),
            st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=12),
        )
    )


def m_output(draw: st.DrawFn, r: Request) -> None:
    outputs = r.head.setdefault("outputs", [])
    if isinstance(outputs, list):
        output: dict[str, Any] = {"name": draw(names)}
        if draw(st.booleans()):
            output["parameters"] = {draw(keys): draw(json_scalars)}
        outputs.append(output)


def m_drop_input(draw: st.DrawFn, r: Request) -> None:
    inputs = r.head.get("inputs")
    if isinstance(inputs, list) and inputs:
        del inputs[-1]


MUTATIONS: list[Callable[[st.DrawFn, Request], None]] = [
    m_model,
    m_top_field,
    m_request_parameter,
    m_input_field,
    m_input_name,
    m_datatype,
    m_shape,
    m_data,
    m_tensor_parameter,
    m_binary,
    m_header_length,
    m_output,
    m_drop_input,
]


@st.composite
def infer_requests(draw: st.DrawFn) -> tuple[str, bytes, dict[str, str]]:
    """A valid request for one of the models with one to four random mutations, encoded."""
    model = draw(st.sampled_from(["add_sub", "vec"]))
    request = valid_request(model, binary=model == "add_sub" and draw(st.booleans()))
    for mutate in draw(st.lists(st.sampled_from(MUTATIONS), min_size=1, max_size=4)):
        mutate(draw, request)
    return request.encode(ensure_ascii=draw(st.booleans()))


# ---- checks ------------------------------------------------------------------------------------------------


def send(daemon: RunningDaemon, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, Any]:
    status, reply, raw = http_request(daemon.http_address, "POST", path, body, headers)
    assert status in CLEAN, f"{status}: {raw[:500]!r}\n{path} {headers} {body[:500]!r}"
    if status != 200:
        assert isinstance(reply, dict) and reply.get("error"), (
            f"{status} without an error message: {raw[:200]!r}"
        )
    return status, reply


def assert_unharmed(f: Fuzzed) -> None:
    assert f.daemon.proc.poll() is None, f.daemon.log()
    assert sorted(f.daemon.worker_pids()) == f.pids
    log = f.daemon.log()
    for bad in ("unexpected error", "Traceback", "Unexpected ["):
        assert bad not in log, log[-4000:]
    request = valid_request("add_sub", binary=True)
    status, reply = send(f.daemon, *request.encode(ensure_ascii=True))
    assert status == 200 and reply["outputs"][0]["data"] == [2.0] * 32, reply


def test_random_malformed_requests_end_in_a_clean_status(fuzzed: Fuzzed) -> None:
    seen: dict[int, int] = {}

    @fuzz
    @given(request=infer_requests())
    def one(request: tuple[str, bytes, dict[str, str]]) -> None:
        status, _ = send(fuzzed.daemon, *request)
        seen[status] = seen.get(status, 0) + 1

    one()
    assert seen.get(400, 0) > 0, seen  # the search reached validation
    assert_unharmed(fuzzed)


def test_random_json_tensors_end_in_a_clean_status(fuzzed: Fuzzed) -> None:
    """A valid request but for its elements, whose count the shape agrees with, so each reaches the step
    that turns JSON elements into bytes."""
    element = st.one_of(json_scalars, st.integers(-(2**70), 2**70), st.lists(json_scalars, max_size=3))

    @fuzz
    @given(data=st.lists(element, max_size=12), datatype=st.sampled_from(["INT32", "FP32", "BOOL"]))
    def one(data: list[Any], datatype: str) -> None:
        count = sum(len(d) if isinstance(d, list) else 1 for d in data)
        tensor = {"name": "IN", "shape": [count], "datatype": datatype, "data": data}
        send(fuzzed.daemon, "/v2/models/vec/infer", json.dumps({"inputs": [tensor]}).encode(), {})

    one()
    assert_unharmed(fuzzed)


def test_random_bytes_end_in_a_clean_status(fuzzed: Fuzzed) -> None:
    @fuzz
    @given(
        payload=st.binary(max_size=300),
        length=st.one_of(st.none(), st.integers(0, 400).map(str)),
        model=st.sampled_from(["add_sub", "vec", "nope"]),
    )
    def one(payload: bytes, length: str | None, model: str) -> None:
        send(
            fuzzed.daemon,
            f"/v2/models/{model}/infer",
            payload,
            {HEADER: length} if length is not None else {},
        )

    one()
    assert_unharmed(fuzzed)
