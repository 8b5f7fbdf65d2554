"""String (BYTES) and wide unsigned tensors through the real daemon, with the stock tritonclient: gRPC raw
contents and bytes_contents, HTTP JSON and binary data, system shared memory, dynamic batching of string
requests, string outputs of a decoupled model, and warm-up samples of strings; and a real text model
(a small BERT) called with sentences over gRPC and HTTP, batched with other requests.
"""

from __future__ import annotations

import concurrent.futures
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException, deserialize_bytes_tensor, serialize_byte_tensor

from mpsd.config.model_file import validate_model_config
from mpsd.ipc.strings import serialize as strings_bytes
from tests import models, posix_shm, text_models
from tests.conftest import RunningDaemon, serving, wait_for
from tests.triton_shm import shm

# Upper-cases each string; ROWS is the number of rows of the execution that served it (a batch).
UPPER = """
text = inputs['TEXT']
assert text.dtype == object and all(type(t) is bytes for t in text.flat), text
rows = np.full((text.shape[0], 1), text.shape[0], dtype=np.int32)
return {'UPPER': np.vectorize(lambda t: t.upper(), otypes=[object])(text), 'ROWS': torch.from_numpy(rows)}
"""
# The strings' lengths as UINT32, and the unsigned inputs echoed with their torch dtypes named.
UNSIGNED = """
out = {name: inputs[name] for name in ('U16', 'U32', 'U64')}
out['DTYPES'] = [str(inputs[name].dtype) for name in ('U16', 'U32', 'U64')]
return out
"""
# Yields one response per word, as text (a list of str); ints where the config says strings when asked to.
WORDS = """
for word in inputs['TEXT'][0].split():
    if word == b'bad':
        yield {'WORD': [1, 2]}
    yield {'WORD': [word.decode()]}
"""
# Records what each warm-up sample gave it.
WARM = """
with open(self.config['parameters']['log'], 'a') as log:
    log.write(json.dumps([t.decode() for t in inputs['TEXT'].flat]) + '\\n')
return {'OUT': inputs['TEXT']}
"""


def _model_source(body: str) -> str:
    return "import json\nimport numpy as np\n" + body


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    tmp = tmp_path_factory.mktemp("strings")
    repo = tmp / "repo"
    string = {"data_type": "TYPE_STRING", "dims": [-1]}
    models.python_model(
        repo,
        "upper",
        _model_source(UPPER),
        config={
            "backend": "python",
            "max_batch_size": 16,
            "dynamic_batching": {"max_queue_delay_microseconds": 200_000, "preferred_batch_size": [8]},
            "input": [{"name": "TEXT", **string}],
            "output": [{"name": "UPPER", **string}, {"name": "ROWS", "data_type": "TYPE_INT32", "dims": [1]}],
        },
    )
    models.python_model(
        repo,
        "unsigned",
        UNSIGNED,
        config={
            "backend": "python",
            "max_batch_size": 0,
            "input": [
                {"name": n, "data_type": f"TYPE_UINT{n[1:]}", "dims": [-1]} for n in ("U16", "U32", "U64")
            ],
            "output": [
                *({"name": n, "data_type": f"TYPE_UINT{n[1:]}", "dims": [-1]} for n in ("U16", "U32", "U64")),
                {"name": "DTYPES", **string},
            ],
        },
    )
    models.python_model(
        repo,
        "words",
        WORDS,
        config={
            "backend": "python",
            "max_batch_size": 0,
            "model_transaction_policy": {"decoupled": True},
            "input": [{"name": "TEXT", "data_type": "TYPE_STRING", "dims": [1]}],
            "output": [{"name": "WORD", "data_type": "TYPE_STRING", "dims": [1]}],
        },
    )
    models.python_model(
        repo,
        "warm",
        _model_source(WARM),
        config={
            "backend": "python",
            "max_batch_size": 4,
            "input": [{"name": "TEXT", **string}],
            "output": [{"name": "OUT", **string}],
            "parameters": {"log": str(tmp / "warm.log")},
            "model_warmup": [
                {
                    "name": "empty",
                    "batch_size": 2,
                    "inputs": {"TEXT": {"data_type": "TYPE_STRING", "dims": [3], "zero_data": True}},
                },
                {
                    "name": "random",
                    "inputs": {"TEXT": {"data_type": "TYPE_STRING", "dims": [2], "random_data": True}},
                },
            ],
        },
    )
    for bits in (16, 32, 64):
        models.identity(repo, f"identity_u{bits}", f"TYPE_UINT{bits}", [-1], max_batch_size=4)
    text_models.embedder(
        repo,
        "embedder",
        {
            "backend": "python",
            "max_batch_size": 8,
            "dynamic_batching": {"max_queue_delay_microseconds": 50_000},
            "input": [{"name": "TEXT", "data_type": "TYPE_STRING", "dims": [1]}],
            "output": [{"name": "EMBEDDING", "data_type": "TYPE_FP32", "dims": [text_models.HIDDEN]}],
            "instance_group": [{"kind": "KIND_CPU"}],
        },
    )
    with serving(repo, tmp / "daemon.log") as d:
        yield d


@pytest.fixture(scope="module")
def grpc_client(daemon: RunningDaemon) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(daemon.address)


@pytest.fixture(scope="module")
def http_client(daemon: RunningDaemon) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(daemon.http_address)


TEXTS = np.array([[b"hello", "wörld".encode(), b"", b"\xff\x00raw"]], dtype=np.object_)
UPPERED = np.vectorize(lambda t: t.upper(), otypes=[object])(TEXTS)


def _grpc_upper(client: grpcclient.InferenceServerClient, texts: np.ndarray) -> grpcclient.InferResult:
    text = grpcclient.InferInput("TEXT", list(texts.shape), "BYTES")
    text.set_data_from_numpy(texts)
    return client.infer("upper", [text])


def test_grpc_strings_in_raw_contents_and_out(grpc_client: grpcclient.InferenceServerClient) -> None:
    result = _grpc_upper(grpc_client, TEXTS)
    assert result.as_numpy("UPPER").tolist() == UPPERED.tolist()
    assert result.get_output("UPPER").datatype == "BYTES"
    assert result.as_numpy("ROWS").tolist() == [[1]]


def test_grpc_strings_in_bytes_contents(daemon: RunningDaemon) -> None:
    request = service_pb2.ModelInferRequest(model_name="upper")
    tensor = request.inputs.add(name="TEXT", datatype="BYTES", shape=[2, 2])
    tensor.contents.bytes_contents.extend([b"ab", b"cd", b"", b"e\x00f"])
    with grpc.insecure_channel(daemon.address) as channel:
        response = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request)
    out = {o.name: (o, raw) for o, raw in zip(response.outputs, response.raw_output_contents, strict=True)}
    meta, raw = out["UPPER"]
    assert (meta.datatype, list(meta.shape)) == ("BYTES", [2, 2])
    assert deserialize_bytes_tensor(raw).tolist() == [b"AB", b"CD", b"", b"E\x00F"]


def test_http_strings_as_json_and_binary(http_client: httpclient.InferenceServerClient) -> None:
    texts = np.array([["hello", "wörld", ""]], dtype=np.object_)
    for binary_in in (False, True):
        for binary_out in (False, True):
            text = httpclient.InferInput("TEXT", [1, 3], "BYTES")
            text.set_data_from_numpy(texts, binary_data=binary_in)
            out = httpclient.InferRequestedOutput("UPPER", binary_data=binary_out)
            result = http_client.infer("upper", [text], outputs=[out])
            got = result.as_numpy("UPPER").tolist()
            # JSON answers text (str); binary data answers the bytes (bytes.upper leaves "ö" as it is).
            want = [["HELLO", "WöRLD", ""]] if not binary_out else [[b"HELLO", "WöRLD".encode(), b""]]
            assert got == want, (binary_in, binary_out)


def test_http_non_utf8_output_is_exact_in_binary(http_client: httpclient.InferenceServerClient) -> None:
    text = httpclient.InferInput("TEXT", list(TEXTS.shape), "BYTES")
    text.set_data_from_numpy(TEXTS, binary_data=True)
    result = http_client.infer("upper", [text], outputs=[httpclient.InferRequestedOutput("UPPER")])
    assert result.as_numpy("UPPER").tolist() == UPPERED.tolist()


def test_strings_in_system_shared_memory(grpc_client: grpcclient.InferenceServerClient) -> None:
    texts = np.array([[b"shared", b"memory", b"\x00"]], dtype=np.object_)
    serialized_array = serialize_byte_tensor(texts)  # as Triton's string shared-memory example does
    serialized = serialized_array.item()
    key = posix_shm.checked(f"/mpsd_strings_{uuid.uuid4().hex[:8]}")
    out_key = posix_shm.checked(key + "_out")
    in_handle = shm.create_shared_memory_region("strings_in", key, len(serialized))
    out_handle = shm.create_shared_memory_region("strings_out", out_key, 1024)
    try:
        shm.set_shared_memory_region(in_handle, [serialized_array])
        grpc_client.register_system_shared_memory("strings_in", key, len(serialized))
        grpc_client.register_system_shared_memory("strings_out", out_key, 1024)
        text = grpcclient.InferInput("TEXT", [1, 3], "BYTES")
        text.set_shared_memory("strings_in", len(serialized))
        upper = grpcclient.InferRequestedOutput("UPPER")
        upper.set_shared_memory("strings_out", 1024)
        result = grpc_client.infer("upper", [text], outputs=[upper])
        meta = result.get_output("UPPER")
        got = shm.get_contents_as_numpy(out_handle, np.object_, list(meta.shape))
        assert got.tolist() == [[b"SHARED", b"MEMORY", b"\x00"]]
    finally:
        grpc_client.unregister_system_shared_memory()
        shm.destroy_shared_memory_region(in_handle)
        shm.destroy_shared_memory_region(out_handle)


def test_string_requests_batch_and_each_gets_its_rows(grpc_client: grpcclient.InferenceServerClient) -> None:
    """Requests of different row counts and string lengths, sent at once, are run as batches (ROWS > the
    request's own rows) and each gets its own strings back."""
    sent = [
        np.array([[f"req{i}-row{r}-".encode() * (i + 1)] for r in range(1 + i % 3)], dtype=np.object_)
        for i in range(8)
    ]
    with concurrent.futures.ThreadPoolExecutor(len(sent)) as pool:
        results = list(pool.map(lambda t: _grpc_upper(grpc_client, t), sent))
    for texts, result in zip(sent, results, strict=True):
        assert result.as_numpy("UPPER").tolist() == np.vectorize(bytes.upper, otypes=[object])(texts).tolist()
    assert max(int(r.as_numpy("ROWS").max()) for r in results) > 3  # more than any one request's rows


def test_malformed_serialized_strings_are_refused(daemon: RunningDaemon) -> None:
    cases = {
        b"\x05\x00\x00\x00abc": "string element 0 declares 5 bytes but only 3 follow",
        b"\x01\x00\x00\x00a\x00": "holds 1 string element(s) in 6 bytes, expected 2 "
        "(each is a 4-byte little-endian length followed by its bytes)",
        b"\x01\x00\x00\x00a\x00\x00\x00\x00xyz": "has 3 bytes after its 2 string element(s)",
    }
    with grpc.insecure_channel(daemon.address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for raw, message in cases.items():
            request = service_pb2.ModelInferRequest(model_name="upper")
            request.inputs.add(name="TEXT", datatype="BYTES", shape=[1, 2])
            request.raw_input_contents.append(raw)
            with pytest.raises(grpc.RpcError) as info:
                stub.ModelInfer(request)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.details() == f"input 'TEXT': BYTES data {message}"


def test_strings_are_checked_on_every_request_of_a_known_header(daemon: RunningDaemon) -> None:
    """Requests alike but for their bytes take a fast path that skips checks already made; strings'
    bytes are checked each time: malformed ones of the same size as good ones are still refused."""
    good = strings_bytes([b"ab", b"cd"])
    bad = b"\x09\x00\x00\x00" + b"x" * (len(good) - 4)  # one element claiming more bytes than follow
    with grpc.insecure_channel(daemon.address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for raw in (good, good, good, bad):
            request = service_pb2.ModelInferRequest(model_name="upper")
            request.inputs.add(name="TEXT", datatype="BYTES", shape=[1, 2])
            request.raw_input_contents.append(raw)
            if raw is good:
                stub.ModelInfer(request)
                continue
            with pytest.raises(grpc.RpcError) as info:
                stub.ModelInfer(request)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "string element 0 declares 9 bytes but only 8 follow" in str(info.value.details())


def test_http_json_strings_must_be_strings(
    http_client: httpclient.InferenceServerClient, daemon: RunningDaemon
) -> None:
    import urllib.request

    body = {"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1, 2], "data": ["a", 3]}]}
    request = urllib.request.Request(
        f"http://{daemon.http_address}/v2/models/upper/infer", data=json.dumps(body).encode(), method="POST"
    )
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request)
    assert info.value.code == 400
    assert json.loads(info.value.read())["error"] == "input 'TEXT': BYTES data must be strings, got int"


def test_wide_unsigned_types_reach_a_python_model(
    grpc_client: grpcclient.InferenceServerClient, http_client: httpclient.InferenceServerClient
) -> None:
    values = {
        "U16": np.array([0, 65535], dtype=np.uint16),
        "U32": np.array([1, 2**32 - 1], dtype=np.uint32),
        "U64": np.array([2, 2**64 - 1], dtype=np.uint64),
    }
    for module, client in ((grpcclient, grpc_client), (httpclient, http_client)):
        for binary in (True, False):
            inputs = []
            for name, array in values.items():
                tensor = module.InferInput(name, list(array.shape), f"UINT{name[1:]}")
                if module is httpclient:
                    tensor.set_data_from_numpy(array, binary_data=binary)
                else:
                    tensor.set_data_from_numpy(array)
                inputs.append(tensor)
            result = client.infer("unsigned", inputs)
            for name, array in values.items():
                got = result.as_numpy(name)
                assert got.dtype == array.dtype and got.tolist() == array.tolist(), (module, name)
            assert [d.decode() if isinstance(d, bytes) else d for d in result.as_numpy("DTYPES")] == [
                "torch.uint16",
                "torch.uint32",
                "torch.uint64",
            ]


def test_wide_unsigned_types_reach_a_torchscript_model(grpc_client: grpcclient.InferenceServerClient) -> None:
    """torch holds uint16/32/64 tensors (with few operators): a TorchScript model takes and returns them."""
    for bits in (16, 32, 64):
        array = np.array([[0, 2**bits - 1], [7, 2 ** (bits - 1)]], dtype=f"uint{bits}")
        tensor = grpcclient.InferInput("IN", list(array.shape), f"UINT{bits}")
        tensor.set_data_from_numpy(array)
        got = grpc_client.infer(f"identity_u{bits}", [tensor]).as_numpy("OUT")
        assert got.dtype == array.dtype and got.tolist() == array.tolist()


def test_unsigned_typed_contents(daemon: RunningDaemon) -> None:
    request = service_pb2.ModelInferRequest(model_name="unsigned")
    request.inputs.add(name="U16", datatype="UINT16", shape=[1]).contents.uint_contents.extend([65535])
    request.inputs.add(name="U32", datatype="UINT32", shape=[1]).contents.uint_contents.extend([2**32 - 1])
    request.inputs.add(name="U64", datatype="UINT64", shape=[1]).contents.uint64_contents.extend([2**64 - 1])
    with grpc.insecure_channel(daemon.address) as channel:
        response = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request)
    raw = dict(zip((o.name for o in response.outputs), response.raw_output_contents, strict=True))
    assert np.frombuffer(raw["U64"], np.uint64).tolist() == [2**64 - 1]
    request.inputs[0].contents.uint_contents[0] = 65536
    with grpc.insecure_channel(daemon.address) as channel, pytest.raises(grpc.RpcError) as info:
        service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "out of range for UINT16" in str(info.value.details())


def _stream_words(client: grpcclient.InferenceServerClient, text: bytes, count: int) -> list[Any]:
    """The first `count` responses (results or errors) of `words` to one request."""
    responses: list[Any] = []
    client.start_stream(callback=lambda result, error: responses.append(error or result))
    try:
        tensor = grpcclient.InferInput("TEXT", [1], "BYTES")
        tensor.set_data_from_numpy(np.array([text], dtype=np.object_))
        client.async_stream_infer("words", [tensor])
        wait_for(lambda: len(responses) >= count, 30, f"{count} streamed responses")
    finally:
        client.stop_stream()
    return responses


def test_decoupled_model_streams_strings(grpc_client: grpcclient.InferenceServerClient) -> None:
    responses = _stream_words(grpc_client, b"one two three", 3)
    assert [r.as_numpy("WORD").tolist() for r in responses] == [[b"one"], [b"two"], [b"three"]]


def test_a_model_returning_numbers_for_strings_fails_with_the_reason(
    grpc_client: grpcclient.InferenceServerClient,
) -> None:
    responses = _stream_words(grpc_client, b"ok bad", 2)
    assert responses[0].as_numpy("WORD").tolist() == [b"ok"]
    assert isinstance(responses[1], InferenceServerException)
    assert "a string output holds a int; expected bytes or str" in str(responses[1].message())


def test_warmup_samples_of_strings(daemon: RunningDaemon) -> None:
    log = Path(daemon.repo).parent / "warm.log"
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert lines[0] == [""] * 6  # batch 2 of 3 empty strings
    assert len(lines[1]) == 2 and all(len(t) == 8 for t in lines[1])  # random words


def test_torch_backends_refuse_strings_with_the_reason(tmp_path: Path) -> None:
    config = {
        "backend": "torchscript",
        "input": [{"name": "x", "data_type": "TYPE_STRING", "dims": [1]}],
        "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [1]}],
    }
    with pytest.raises(ValueError) as info:
        validate_model_config(tmp_path / "config.yaml", config)
    assert "input 'x' is TYPE_STRING, which a torchscript model cannot take or return" in str(info.value)
    assert "torch has no string tensors" in str(info.value)


# ---- a real text model: sentences in, embeddings out --------------------------------------------------
# A WordPiece tokenizer trained here with `tokenizers` and a small BERT (random weights from a
# `transformers` config) inside a python model that takes sentences and returns mean-pooled embeddings;
# its answers equal the same code run in this process.

SENTENCES = [
    "the lazy dog sleeps",
    "apple silicon serves pytorch models",
    "embeddings out",
    "an unseen wordpiece like zyzzyva",
    "",
]


@pytest.fixture(scope="module")
def served(daemon: RunningDaemon) -> tuple[RunningDaemon, Path]:
    """The daemon once its embedder is ready (its worker imports transformers: seconds of CPU), and the
    embedder's version folder."""
    wait_for(lambda: daemon.client.is_model_ready("embedder"), 300, f"the embedder to load\n{daemon.log()}")
    return daemon, Path(daemon.repo) / "embedder" / "1"


def _reference(folder: Path, sentences: list[str]) -> np.ndarray:
    return text_models.reference(folder, sentences)[0]


def test_strings_in_embeddings_out_over_grpc_and_http(served: tuple[RunningDaemon, Path]) -> None:
    daemon, folder = served
    expected = _reference(folder, SENTENCES)
    texts = np.array([[s.encode()] for s in SENTENCES], dtype=np.object_)
    grpc_in = grpcclient.InferInput("TEXT", list(texts.shape), "BYTES")
    grpc_in.set_data_from_numpy(texts)
    got_grpc = (
        grpcclient.InferenceServerClient(daemon.address).infer("embedder", [grpc_in]).as_numpy("EMBEDDING")
    )
    np.testing.assert_allclose(got_grpc, expected, rtol=1e-4, atol=1e-5)
    client = httpclient.InferenceServerClient(daemon.http_address)
    for binary in (False, True):
        http_in = httpclient.InferInput("TEXT", list(texts.shape), "BYTES")
        http_in.set_data_from_numpy(texts, binary_data=binary)
        got_http = client.infer("embedder", [http_in]).as_numpy("EMBEDDING")
        np.testing.assert_allclose(got_http, expected, rtol=1e-4, atol=1e-5)


def test_sentences_sent_at_once_are_batched_and_each_gets_its_own(served: tuple[RunningDaemon, Path]) -> None:
    daemon, folder = served
    expected = _reference(folder, SENTENCES)
    client = grpcclient.InferenceServerClient(daemon.address)

    def one(sentence: str) -> np.ndarray:
        text = grpcclient.InferInput("TEXT", [1, 1], "BYTES")
        text.set_data_from_numpy(np.array([[sentence.encode()]], dtype=np.object_))
        return client.infer("embedder", [text]).as_numpy("EMBEDDING")[0]

    before = client.get_inference_statistics("embedder", as_json=True)["model_stats"][0]
    with concurrent.futures.ThreadPoolExecutor(len(SENTENCES)) as pool:
        got = np.stack(list(pool.map(one, SENTENCES)))
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    after = client.get_inference_statistics("embedder", as_json=True)["model_stats"][0]
    executions = int(after.get("execution_count", 0)) - int(before.get("execution_count", 0))
    assert executions < len(SENTENCES)  # some were run together
