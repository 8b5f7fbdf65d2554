"""The flows of Triton's own Python client examples (triton-inference-server/client, `src/python/examples`),
rewritten as tests with the stock tritonclient against one daemon that calls itself `triton`, serving the
models the examples expect, built here: `simple` (INT32 sum and difference, batched), `simple_int8`,
`simple_string` (integers as text), `simple_identity` (strings), `repeat_int32` (decoupled) and an image
classifier with labels. Each test names the examples whose steps it takes. Not here: the sequence examples
(`simple_*_sequence_*`, in tests/test_sequences.py), the ensemble one (`ensemble_image_client`, in
tests/test_ensemble.py), and those of CUDA shared memory (`simple_*_cudashm_client`), which need a GPU.
"""

from __future__ import annotations

import asyncio
import json
import queue
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.grpc.model_config_pb2 as mc
import tritonclient.http as httpclient
import tritonclient.http.aio as httpaio
import yaml
from torch import nn
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import (
    InferenceServerException,
    deserialize_bytes_tensor,
    serialize_byte_tensor,
    serialized_byte_size,
    triton_to_np_dtype,
)

from tests import models, posix_shm
from tests.conftest import RunningDaemon, serving
from tests.triton_shm import shm

# Triton's simple_string: the sum and difference of integers written as text, answered as text.
SIMPLE_STRING = """
import numpy as np
number = np.vectorize(lambda text: int(text or 0), otypes=[np.int64])  # warm-up sends empty strings
a, b = number(inputs['INPUT0']), number(inputs['INPUT1'])
text = np.vectorize(lambda value: str(value).encode(), otypes=[object])
return {'OUTPUT0': text(a + b), 'OUTPUT1': text(a - b)}
"""
# Triton's repeat backend: one response per element of IN, each after its DELAY (ms), then WAIT (ms).
REPEAT = """
values = inputs['IN'].tolist()
delays = inputs['DELAY'].to(torch.int64).tolist()
for index, value in enumerate(values):
    time.sleep(delays[index] / 1000)
    yield {'OUT': torch.tensor([value], dtype=torch.int32), 'IDX': torch.tensor([index]).to(torch.uint32)}
time.sleep(int(inputs['WAIT'].to(torch.int64)[0]) / 1000)
"""
LABELS = ["red", "green", "blue", "yellow", "cyan"]


class ChannelScores(nn.Module):
    """An image classifier whose scores are known: the mean of each channel, red+green and blue-red."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = x.mean(dim=(2, 3))
        return torch.stack([m[:, 0], m[:, 1], m[:, 2], m[:, 0] + m[:, 1], m[:, 2] - m[:, 0]], dim=1)


def _scores(images: np.ndarray) -> np.ndarray:
    m = images.mean(axis=(2, 3))
    return np.stack([m[:, 0], m[:, 1], m[:, 2], m[:, 0] + m[:, 1], m[:, 2] - m[:, 0]], axis=1)


def _top(images: np.ndarray, k: int) -> list[list[str]]:
    """What the classification extension answers for each image: "value:index:label", best first."""
    return [
        [f"{row[i]:f}:{i}:{LABELS[i]}" for i in sorted(range(len(row)), key=lambda i: (-row[i], i))[:k]]
        for row in _scores(images).astype(np.float32)
    ]


def _io(names: list[str], data_type: str, dims: list[int]) -> list[dict[str, Any]]:
    return [{"name": name, "data_type": data_type, "dims": dims} for name in names]


def _simple(repo: Path, name: str, data_type: str) -> None:
    models.write_config(
        repo / name,
        {
            "backend": "torchscript",
            "max_batch_size": 8,
            "input": _io(["INPUT0", "INPUT1"], data_type, [16]),
            "output": _io(["OUTPUT0", "OUTPUT1"], data_type, [16]),
        },
    )
    models.save_torchscript(models.AddSub(), repo / name / "1" / "model.pt")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    tmp = tmp_path_factory.mktemp("triton_examples")
    repo = tmp / "repo"
    _simple(repo, "simple", "TYPE_INT32")
    _simple(repo, "simple_int8", "TYPE_INT8")
    strings = {"backend": "python", "max_batch_size": 8}
    models.python_model(
        repo,
        "simple_string",
        SIMPLE_STRING,
        config={
            **strings,
            "input": _io(["INPUT0", "INPUT1"], "TYPE_STRING", [16]),
            "output": _io(["OUTPUT0", "OUTPUT1"], "TYPE_STRING", [16]),
        },
    )
    models.python_model(
        repo,
        "simple_identity",
        "return {'OUTPUT0': inputs['INPUT0']}",
        config={
            **strings,
            "input": _io(["INPUT0"], "TYPE_STRING", [-1]),
            "output": _io(["OUTPUT0"], "TYPE_STRING", [-1]),
        },
    )
    models.python_model(
        repo,
        "repeat_int32",
        REPEAT,
        config={
            "backend": "python",
            "max_batch_size": 0,
            "model_transaction_policy": {"decoupled": True},
            "input": _io(["IN"], "TYPE_INT32", [-1])
            + _io(["DELAY"], "TYPE_UINT32", [-1])
            + _io(["WAIT"], "TYPE_UINT32", [1]),
            "output": _io(["OUT"], "TYPE_INT32", [1]) + _io(["IDX"], "TYPE_UINT32", [1]),
        },
    )
    models.write_config(
        repo / "classifier",
        {
            "backend": "torchscript",
            "max_batch_size": 8,
            "input": [
                {"name": "data_0", "data_type": "TYPE_FP32", "dims": [3, 8, 8], "format": "FORMAT_NCHW"}
            ],
            "output": [
                {"name": "fc6_1", "data_type": "TYPE_FP32", "dims": [5], "label_filename": "labels.txt"}
            ],
        },
    )
    (repo / "classifier" / "labels.txt").write_text("".join(f"{label}\n" for label in LABELS))
    models.save_torchscript(ChannelScores(), repo / "classifier" / "1" / "model.pt")
    config = tmp / "mpsd.yaml"
    config.write_text(
        yaml.safe_dump({"server_name": "triton", "model_control": "explicit", "metrics_address": ""})
    )
    with serving(repo, tmp / "daemon.log", config=config) as d:
        yield d


# The data every `simple` example sends: 0..15 and ones (the HTTP examples: minus ones).
IN0 = np.arange(16, dtype=np.int32).reshape(1, 16)
IN1 = np.ones((1, 16), dtype=np.int32)


def _sum_and_difference(result: Any, in0: np.ndarray = IN0, in1: np.ndarray = IN1) -> None:
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), in0 + in1)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), in0 - in1)


def _grpc_inputs(in0: np.ndarray = IN0, in1: np.ndarray = IN1) -> list[grpcclient.InferInput]:
    inputs = [
        grpcclient.InferInput("INPUT0", [1, 16], "INT32"),
        grpcclient.InferInput("INPUT1", [1, 16], "INT32"),
    ]
    inputs[0].set_data_from_numpy(in0)
    inputs[1].set_data_from_numpy(in1)
    return inputs


def _grpc_outputs() -> list[grpcclient.InferRequestedOutput]:
    return [grpcclient.InferRequestedOutput("OUTPUT0"), grpcclient.InferRequestedOutput("OUTPUT1")]


CLIENT_OPTIONS: dict[str, dict[str, Any]] = {
    "plain": {},
    # simple_grpc_custom_args_client: the channel arguments it passes
    "custom_args": {
        "channel_args": [
            ("grpc.max_send_message_length", 1024 * 1024),
            ("grpc.max_receive_message_length", 1024 * 1024),
            ("grpc.keepalive_time_ms", 2**31 - 1),
            ("grpc.keepalive_timeout_ms", 20000),
            ("grpc.keepalive_permit_without_calls", False),
            ("grpc.http2.max_pings_without_data", 2),
            ("grpc.dns_enable_srv_queries", 1),
        ]
    },
    # simple_grpc_keepalive_client: its defaults
    "keepalive": {
        "keepalive_options": grpcclient.KeepAliveOptions(
            keepalive_time_ms=2**31 - 1,
            keepalive_timeout_ms=20000,
            keepalive_permit_without_calls=False,
            http2_max_pings_without_data=2,
        )
    },
}


@pytest.mark.parametrize("compression", [None, "gzip", "deflate"])
@pytest.mark.parametrize("options", list(CLIENT_OPTIONS))
def test_grpc_infer(daemon: RunningDaemon, options: str, compression: str | None) -> None:
    """simple_grpc_infer_client (also with -C gzip|deflate), simple_grpc_custom_args_client and
    simple_grpc_keepalive_client: outputs named and not, a header, the model's statistics."""
    client = grpcclient.InferenceServerClient(daemon.address, **CLIENT_OPTIONS[options])
    inputs = _grpc_inputs()
    named = client.infer(
        "simple", inputs, outputs=_grpc_outputs(), headers={"test": "1"}, compression_algorithm=compression
    )
    _sum_and_difference(named)
    assert len(client.get_inference_statistics(model_name="simple").model_stats) == 1
    _sum_and_difference(client.infer("simple", inputs, outputs=None, compression_algorithm=compression))


def _http_infer(
    client: httpclient.InferenceServerClient,
    model: str,
    in0: np.ndarray,
    in1: np.ndarray,
    named: bool,
    **kw: Any,
) -> Any:
    """simple_http_infer_client's request: INPUT0 as JSON, INPUT1 binary; OUTPUT0 binary, OUTPUT1 JSON."""
    inputs = [
        httpclient.InferInput("INPUT0", [1, 16], "INT32"),
        httpclient.InferInput("INPUT1", [1, 16], "INT32"),
    ]
    inputs[0].set_data_from_numpy(in0, binary_data=False)
    inputs[1].set_data_from_numpy(in1, binary_data=True)
    outputs = [
        httpclient.InferRequestedOutput("OUTPUT0", binary_data=True),
        httpclient.InferRequestedOutput("OUTPUT1", binary_data=False),
    ]
    return client.infer(
        model, inputs, outputs=outputs if named else None, query_params={"test_1": 1, "test_2": 2}, **kw
    )


@pytest.mark.parametrize("compression", [None, "gzip", "deflate"])
def test_http_infer(daemon: RunningDaemon, compression: str | None) -> None:
    """simple_http_infer_client (with -H headers and both compression options): JSON and binary tensors
    both ways, outputs named and not, statistics, and Triton's message for a wrong model name."""
    client = httpclient.InferenceServerClient(daemon.http_address)
    in1 = np.full((1, 16), -1, dtype=np.int32)
    kw: dict[str, Any] = {
        "headers": {"X-Example": "1"},
        "request_compression_algorithm": compression,
        "response_compression_algorithm": compression,
    }
    _sum_and_difference(_http_infer(client, "simple", IN0, in1, named=True, **kw), in1=in1)
    assert len(client.get_inference_statistics(model_name="simple")["model_stats"]) == 1
    _sum_and_difference(_http_infer(client, "simple", IN0, in1, named=False, **kw), in1=in1)
    with pytest.raises(InferenceServerException) as info:
        _http_infer(client, "wrong_model_name", IN0, in1, named=True)
    assert info.value.message().startswith("Request for unknown model")


def test_async_infer(daemon: RunningDaemon) -> None:
    """simple_grpc_async_infer_client (a callback) and simple_http_async_infer_client (two requests in
    flight on a client of concurrency 2, all binary)."""
    answers: queue.Queue[Any] = queue.Queue()
    grpc_client = grpcclient.InferenceServerClient(daemon.address)
    grpc_client.async_infer(
        "simple", _grpc_inputs(), lambda result, error: answers.put(error or result), outputs=_grpc_outputs()
    )
    _sum_and_difference(answers.get(timeout=30))

    http_client = httpclient.InferenceServerClient(daemon.http_address, concurrency=2)
    inputs = [
        httpclient.InferInput("INPUT0", [1, 16], "INT32"),
        httpclient.InferInput("INPUT1", [1, 16], "INT32"),
    ]
    inputs[0].set_data_from_numpy(IN0, binary_data=True)
    inputs[1].set_data_from_numpy(IN1, binary_data=True)
    outputs = [httpclient.InferRequestedOutput(n, binary_data=True) for n in ("OUTPUT0", "OUTPUT1")]
    pending = [http_client.async_infer("simple", inputs, outputs=outputs) for _ in range(2)]
    for request in pending:
        _sum_and_difference(request.get_result())
    http_client.close()


def test_asyncio_clients(daemon: RunningDaemon) -> None:
    """simple_grpc_aio_infer_client and simple_http_aio_infer_client: one request, statistics, then two at
    once with asyncio.gather; over HTTP also the wrong model's message."""

    async def grpc_flow() -> None:
        client = grpcaio.InferenceServerClient(daemon.address)
        inputs = [
            grpcaio.InferInput("INPUT0", [1, 16], "INT32"),
            grpcaio.InferInput("INPUT1", [1, 16], "INT32"),
        ]
        inputs[0].set_data_from_numpy(IN0)
        inputs[1].set_data_from_numpy(IN1)
        outputs = [grpcaio.InferRequestedOutput("OUTPUT0"), grpcaio.InferRequestedOutput("OUTPUT1")]
        _sum_and_difference(await client.infer("simple", inputs, outputs=outputs, headers={"test": "1"}))
        assert len((await client.get_inference_statistics(model_name="simple")).model_stats) == 1
        for result in await asyncio.gather(client.infer("simple", inputs), client.infer("simple", inputs)):
            _sum_and_difference(result)
        await client.close()

    async def http_flow() -> None:
        client = httpaio.InferenceServerClient(daemon.http_address)
        in1 = np.full((1, 16), -1, dtype=np.int32)

        async def infer(model: str, named: bool) -> Any:
            inputs = [
                httpaio.InferInput("INPUT0", [1, 16], "INT32"),
                httpaio.InferInput("INPUT1", [1, 16], "INT32"),
            ]
            inputs[0].set_data_from_numpy(IN0, binary_data=False)
            inputs[1].set_data_from_numpy(in1, binary_data=True)
            outputs = [
                httpaio.InferRequestedOutput("OUTPUT0", binary_data=True),
                httpaio.InferRequestedOutput("OUTPUT1", binary_data=False),
            ]
            return await client.infer(
                model, inputs, outputs=outputs if named else None, query_params={"test_1": 1}
            )

        try:
            _sum_and_difference(await infer("simple", named=True), in1=in1)
            assert len((await client.get_inference_statistics(model_name="simple"))["model_stats"]) == 1
            with pytest.raises(InferenceServerException) as info:
                await infer("wrong_model_name", named=True)
            assert info.value.message().startswith("Request for unknown model")
            for result in await asyncio.gather(infer("simple", named=True), infer("simple", named=False)):
                _sum_and_difference(result, in1=in1)
        finally:
            await client.close()

    asyncio.run(grpc_flow())
    asyncio.run(http_flow())


def _stub(daemon: RunningDaemon) -> service_pb2_grpc.GRPCInferenceServiceStub:
    return service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(daemon.address))


def _typed_request(model: str, datatype: str, fill: Callable[[Any, int], None]) -> Any:
    request = service_pb2.ModelInferRequest(model_name=model, model_version="")
    for index in range(2):
        tensor = service_pb2.ModelInferRequest.InferInputTensor(
            name=f"INPUT{index}", datatype=datatype, shape=[1, 16]
        )
        fill(tensor.contents, index)
        request.inputs.append(tensor)
    for name in ("OUTPUT0", "OUTPUT1"):
        request.outputs.append(service_pb2.ModelInferRequest.InferRequestedOutputTensor(name=name))
    return request


def _int_contents(contents: Any, index: int) -> None:
    contents.int_contents[:] = list(range(16)) if index == 0 else [1] * 16


def test_explicit_typed_contents(daemon: RunningDaemon) -> None:
    """grpc_explicit_int_content_client, grpc_explicit_int8_content_client, grpc_explicit_byte_content_client:
    inputs in the typed `contents` fields through the bare stub, raw outputs back; then Triton's messages for
    contents beside raw_input_contents and for a version string that is no integer."""
    stub = _stub(daemon)
    for model, dtype in (("simple", np.int32), ("simple_int8", np.int8)):
        request = _typed_request(model, "INT32" if dtype is np.int32 else "INT8", _int_contents)
        response = stub.ModelInfer(request)
        out = [
            np.frombuffer(raw, dtype=dtype).reshape(list(o.shape))
            for raw, o in zip(response.raw_output_contents, response.outputs, strict=True)
        ]
        np.testing.assert_array_equal(out[0], IN0 + 1)
        np.testing.assert_array_equal(out[1], IN0 - 1)

    def text(contents: Any, index: int) -> None:
        contents.bytes_contents.extend([str(i).encode() for i in range(16)] if index == 0 else [b"1"] * 16)

    response = stub.ModelInfer(_typed_request("simple_string", "BYTES", text))
    sums, differences = (deserialize_bytes_tensor(raw) for raw in response.raw_output_contents)
    assert [int(s) for s in sums] == list(range(1, 17)) and [int(d) for d in differences] == list(
        range(-1, 15)
    )

    mixed = _typed_request("simple", "INT32", _int_contents)
    mixed.raw_input_contents.extend([np.arange(8).tobytes()])
    mixed.inputs[0].contents.int_contents[:] = list(range(8, 16))
    with pytest.raises(grpc.RpcError) as raised:
        stub.ModelInfer(mixed)
    assert (
        "contents field must not be specified when using raw_input_contents for 'INPUT0' for model 'simple'"
        in str(raised.value)
    )

    wrong_version = _typed_request("simple_int8", "INT8", _int_contents)
    wrong_version.model_version = "wrong_specification"
    with pytest.raises(grpc.RpcError) as raised:
        stub.ModelInfer(wrong_version)
    assert "failed to get model version from specified version string 'wrong_specification'" in str(
        raised.value
    )


def test_health_and_metadata(daemon: RunningDaemon) -> None:
    """simple_grpc_health_metadata and simple_http_health_metadata: liveness with headers and query
    parameters, readiness, the server's name `triton`, the model's metadata and config, and Triton's message
    for an unknown model."""
    grpc_client = grpcclient.InferenceServerClient(daemon.address)
    assert grpc_client.is_server_live(headers={"test": "1", "dummy": "2"})
    assert grpc_client.is_server_ready() and grpc_client.is_model_ready("simple")
    assert grpc_client.get_server_metadata().name == "triton"
    assert grpc_client.get_model_metadata("simple", headers={"test": "1"}).name == "simple"
    with pytest.raises(InferenceServerException) as info:
        grpc_client.get_model_metadata("wrong_model_name")
    assert "Request for unknown model" in info.value.message()
    assert grpc_client.get_model_config("simple").config.name == "simple"

    http_client = httpclient.InferenceServerClient(daemon.http_address)
    assert http_client.is_server_live(query_params={"test_1": 1, "test_2": 2})
    assert http_client.is_server_ready() and http_client.is_model_ready("simple")
    assert http_client.get_server_metadata()["name"] == "triton"
    assert http_client.get_model_metadata("simple", query_params={"test_1": 1})["name"] == "simple"
    with pytest.raises(InferenceServerException) as info:
        http_client.get_model_metadata("wrong_model_name")
    assert "Request for unknown model" in info.value.message()


class _Regions:
    """Client-owned POSIX regions, named uniquely so that test runs side by side never share one."""

    def __init__(self) -> None:
        self.handles: list[Any] = []
        self.tag = uuid.uuid4().hex[:8]

    def create(self, client: Any, name: str, size: int, data: list[np.ndarray] | None = None) -> Any:
        key = posix_shm.checked(f"/mpsd_ex_{self.tag}_{len(self.handles)}")  # macOS: 31 characters at most
        handle = shm.create_shared_memory_region(name, key, size)
        self.handles.append(handle)
        if data is not None:
            for offset, array in zip(np.cumsum([0] + [a.nbytes for a in data[:-1]]), data, strict=True):
                shm.set_shared_memory_region(handle, [array], offset=int(offset))
        client.register_system_shared_memory(name, key, size)
        return handle

    def close(self, client: Any) -> None:
        client.unregister_system_shared_memory()
        for handle in self.handles:
            shm.destroy_shared_memory_region(handle)


def _output_meta(result: Any, name: str) -> tuple[str, list[int]]:
    meta = result.get_output(name)
    if isinstance(meta, dict):
        return meta["datatype"], meta["shape"]
    return meta.datatype, list(meta.shape)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_system_shared_memory(daemon: RunningDaemon, protocol: str) -> None:
    """simple_grpc_shm_client and simple_http_shm_client: both inputs in one region at two offsets, both
    outputs written into another, the regions' status; all regions unregistered at the end (CUDA ones too,
    none of which are registered)."""
    lib: Any = grpcclient if protocol == "grpc" else httpclient
    client = lib.InferenceServerClient(daemon.address if protocol == "grpc" else daemon.http_address)
    client.unregister_system_shared_memory()
    client.unregister_cuda_shared_memory()
    size = IN0.nbytes
    regions = _Regions()
    try:
        out_handle = regions.create(client, "output_data", 2 * size)
        regions.create(client, "input_data", 2 * size, [IN0, IN1])
        inputs = [lib.InferInput("INPUT0", [1, 16], "INT32"), lib.InferInput("INPUT1", [1, 16], "INT32")]
        inputs[0].set_shared_memory("input_data", size)
        inputs[1].set_shared_memory("input_data", size, offset=size)
        outputs = [lib.InferRequestedOutput("OUTPUT0"), lib.InferRequestedOutput("OUTPUT1")]
        outputs[0].set_shared_memory("output_data", size)
        outputs[1].set_shared_memory("output_data", size, offset=size)
        result = client.infer("simple", inputs, outputs=outputs)
        for index, (name, expected) in enumerate((("OUTPUT0", IN0 + IN1), ("OUTPUT1", IN0 - IN1))):
            datatype, shape = _output_meta(result, name)
            got = shm.get_contents_as_numpy(
                out_handle, triton_to_np_dtype(datatype), shape, offset=index * size
            )
            np.testing.assert_array_equal(got, expected)
        status = client.get_system_shared_memory_status()
        names = (
            {r.name for r in status.regions.values()} if protocol == "grpc" else {r["name"] for r in status}
        )
        assert names == {"input_data", "output_data"}
    finally:
        regions.close(client)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_strings_in_system_shared_memory(daemon: RunningDaemon, protocol: str) -> None:
    """simple_grpc_shm_string_client and simple_http_shm_string_client: serialized strings in, the answers
    written into output regions exactly their serialized size."""
    lib: Any = grpcclient if protocol == "grpc" else httpclient
    client = lib.InferenceServerClient(daemon.address if protocol == "grpc" else daemon.http_address)
    client.unregister_system_shared_memory()
    text = np.vectorize(lambda v: str(v).encode(), otypes=[object])
    serialized = [serialize_byte_tensor(text(a[0])) for a in (IN0, IN1, IN0 + IN1, IN0 - IN1)]
    sizes = [serialized_byte_size(s) for s in serialized]
    regions = _Regions()
    try:
        regions.create(client, "input0_data", sizes[0], [serialized[0]])
        regions.create(client, "input1_data", sizes[1], [serialized[1]])
        out = [regions.create(client, f"output{i}_data", sizes[2 + i]) for i in range(2)]
        inputs = [lib.InferInput(f"INPUT{i}", [1, 16], "BYTES") for i in range(2)]
        for i, tensor in enumerate(inputs):
            tensor.set_shared_memory(f"input{i}_data", sizes[i])
        outputs = [lib.InferRequestedOutput(f"OUTPUT{i}") for i in range(2)]
        for i, tensor in enumerate(outputs):
            tensor.set_shared_memory(f"output{i}_data", sizes[2 + i])
        result = client.infer("simple_string", inputs, outputs=outputs)
        for i, expected in enumerate((IN0 + IN1, IN0 - IN1)):
            datatype, shape = _output_meta(result, f"OUTPUT{i}")
            got = shm.get_contents_as_numpy(out[i], triton_to_np_dtype(datatype), shape)
            assert got.tolist() == text(expected).tolist()
    finally:
        regions.close(client)


def test_reuse_infer_objects(daemon: RunningDaemon) -> None:
    """reuse_infer_objects_client, both protocols: the same InferInput and InferRequestedOutput objects go
    from shared memory to data in the request and back (unset_shared_memory)."""
    for lib, address in ((grpcclient, daemon.address), (httpclient, daemon.http_address)):
        client: Any = lib.InferenceServerClient(address)
        client.unregister_system_shared_memory()
        size = IN0.nbytes
        regions = _Regions()
        try:
            out = [regions.create(client, f"output{i}_data", size) for i in range(2)]
            regions.create(client, "input0_data", size, [IN0])
            regions.create(client, "input1_data", size, [IN1])
            inputs = [lib.InferInput(f"INPUT{i}", [1, 16], "INT32") for i in range(2)]
            outputs = [lib.InferRequestedOutput(f"OUTPUT{i}") for i in range(2)]
            for use_shm in (True, False, True):
                in1 = IN1 if use_shm else IN1 * 2
                for i in range(2):
                    if use_shm:
                        inputs[i].set_shared_memory(f"input{i}_data", size)
                        outputs[i].set_shared_memory(f"output{i}_data", size)
                    else:
                        inputs[i].set_data_from_numpy(IN0 if i == 0 else in1)
                        outputs[i].unset_shared_memory()
                result = client.infer("simple", inputs, outputs=outputs)
                for i, expected in enumerate((IN0 + in1, IN0 - in1)):
                    if use_shm:
                        datatype, shape = _output_meta(result, f"OUTPUT{i}")
                        got = shm.get_contents_as_numpy(out[i], triton_to_np_dtype(datatype), shape)
                    else:
                        got = result.as_numpy(f"OUTPUT{i}")
                    np.testing.assert_array_equal(got, expected)
        finally:
            regions.close(client)


def _strings(values: np.ndarray) -> np.ndarray:
    return np.array([str(v).encode() for v in values.flat], dtype=np.object_).reshape(values.shape)


NULL_CHARS = np.array([b"he\x00llo"] * 16, dtype=np.object_).reshape(1, 16)
RAW_BYTES = np.array([b"\x00\x01\x02\x03"] * 16, dtype=np.bytes_).reshape(1, 16)


def test_grpc_strings(daemon: RunningDaemon) -> None:
    """simple_grpc_string_infer_client: simple_string's sums as text, and simple_identity giving back strings
    with a NUL inside and fixed-width bytes."""
    client = grpcclient.InferenceServerClient(daemon.address)
    inputs = [grpcclient.InferInput(f"INPUT{i}", [1, 16], "BYTES") for i in range(2)]
    inputs[0].set_data_from_numpy(_strings(IN0))
    inputs[1].set_data_from_numpy(_strings(IN1))
    result = client.infer(
        "simple_string", inputs, outputs=[grpcclient.InferRequestedOutput(f"OUTPUT{i}") for i in range(2)]
    )
    assert result.as_numpy("OUTPUT0").astype(np.int64).tolist() == (IN0 + IN1).tolist()
    assert result.as_numpy("OUTPUT1").astype(np.int64).tolist() == (IN0 - IN1).tolist()
    for data in (NULL_CHARS, RAW_BYTES):
        tensor = grpcclient.InferInput("INPUT0", list(data.shape), "BYTES")
        tensor.set_data_from_numpy(data)
        out = client.infer(
            "simple_identity", [tensor], outputs=[grpcclient.InferRequestedOutput("OUTPUT0")]
        ).as_numpy("OUTPUT0")
        assert out.dtype == np.object_ and out.tolist() == data.astype(np.object_).tolist()


def test_http_strings(daemon: RunningDaemon) -> None:
    """simple_http_string_infer_client: INPUT0 binary and INPUT1 as JSON, OUTPUT0 binary and OUTPUT1 JSON;
    simple_identity with binary data and with JSON (where strings come back as text)."""
    client = httpclient.InferenceServerClient(daemon.http_address)
    inputs = [httpclient.InferInput(f"INPUT{i}", [1, 16], "BYTES") for i in range(2)]
    inputs[0].set_data_from_numpy(_strings(IN0), binary_data=True)
    inputs[1].set_data_from_numpy(_strings(IN1), binary_data=False)
    outputs = [
        httpclient.InferRequestedOutput("OUTPUT0", binary_data=True),
        httpclient.InferRequestedOutput("OUTPUT1", binary_data=False),
    ]
    result = client.infer("simple_string", inputs, outputs=outputs)
    assert result.as_numpy("OUTPUT0").astype(np.int64).tolist() == (IN0 + IN1).tolist()
    assert result.as_numpy("OUTPUT1").astype(np.int64).tolist() == (IN0 - IN1).tolist()
    for data in (NULL_CHARS, RAW_BYTES):
        for binary in (True, False):
            tensor = httpclient.InferInput("INPUT0", list(data.shape), "BYTES")
            tensor.set_data_from_numpy(data, binary_data=binary)
            wanted = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary)]
            out = client.infer("simple_identity", [tensor], outputs=wanted).as_numpy("OUTPUT0")
            got = [v if isinstance(v, bytes) else str(v).encode() for v in out.flat]
            assert got == data.flatten().tolist(), (data.dtype, binary)


def test_decoupled_repeat(daemon: RunningDaemon) -> None:
    """simple_grpc_custom_repeat: one request on a stream to the decoupled repeat_int32 answers ten
    responses, one value each in order, with only the output asked for."""
    responses: queue.Queue[Any] = queue.Queue()
    count = 10
    values = np.arange(100, 100 + count, dtype=np.int32)
    inputs = [
        grpcclient.InferInput("IN", [count], "INT32"),
        grpcclient.InferInput("DELAY", [count], "UINT32"),
        grpcclient.InferInput("WAIT", [1], "UINT32"),
    ]
    inputs[0].set_data_from_numpy(values)
    inputs[1].set_data_from_numpy(np.full(count, 5, dtype=np.uint32))
    inputs[2].set_data_from_numpy(np.array([5], dtype=np.uint32))
    with grpcclient.InferenceServerClient(daemon.address) as client:
        client.start_stream(callback=lambda result, error: responses.put(error or result))
        client.async_stream_infer("repeat_int32", inputs, outputs=[grpcclient.InferRequestedOutput("OUT")])
        got = [responses.get(timeout=30) for _ in range(count)]
        client.stop_stream()
    assert not [r for r in got if isinstance(r, InferenceServerException)]
    assert [r.as_numpy("OUT").tolist() for r in got] == [[v] for v in values.tolist()]
    assert all(r.as_numpy("IDX") is None for r in got)
    assert responses.empty()


def test_memory_growth_flow(daemon: RunningDaemon) -> None:
    """memory_growth_test: a new client for every request, over both protocols; each answer exact."""
    for lib, address in ((grpcclient, daemon.address), (httpclient, daemon.http_address)):
        for _ in range(10):
            client: Any = lib.InferenceServerClient(address)
            result = client.infer("simple", _grpc_inputs() if lib is grpcclient else _http_inputs())
            _sum_and_difference(result)
            client.close()


def _http_inputs() -> list[httpclient.InferInput]:
    inputs = [
        httpclient.InferInput("INPUT0", [1, 16], "INT32"),
        httpclient.InferInput("INPUT1", [1, 16], "INT32"),
    ]
    inputs[0].set_data_from_numpy(IN0)
    inputs[1].set_data_from_numpy(IN1)
    return inputs


IMAGES = np.random.default_rng(7).random((3, 3, 8, 8), dtype=np.float32)


def test_grpc_client_raw_stub(daemon: RunningDaemon) -> None:
    """grpc_client: every health and metadata RPC through the bare stub, then an image as raw bytes with a
    request id, which the response carries back."""
    stub = _stub(daemon)
    assert stub.ServerLive(service_pb2.ServerLiveRequest()).live
    assert stub.ServerReady(service_pb2.ServerReadyRequest()).ready
    assert stub.ModelReady(service_pb2.ModelReadyRequest(name="classifier", version="")).ready
    assert stub.ServerMetadata(service_pb2.ServerMetadataRequest()).name == "triton"
    metadata = stub.ModelMetadata(service_pb2.ModelMetadataRequest(name="classifier", version=""))
    assert [i.name for i in metadata.inputs] == ["data_0"] and [o.name for o in metadata.outputs] == ["fc6_1"]
    config = stub.ModelConfig(service_pb2.ModelConfigRequest(name="classifier", version="")).config
    assert config.input[0].format == mc.ModelInput.FORMAT_NCHW
    request = service_pb2.ModelInferRequest(model_name="classifier", model_version="", id="my request id")
    request.inputs.append(
        service_pb2.ModelInferRequest.InferInputTensor(name="data_0", datatype="FP32", shape=[1, 3, 8, 8])
    )
    request.outputs.append(service_pb2.ModelInferRequest.InferRequestedOutputTensor(name="fc6_1"))
    request.raw_input_contents.append(IMAGES[:1].tobytes())
    response = stub.ModelInfer(request)
    assert response.id == "my request id"
    np.testing.assert_allclose(
        np.frombuffer(response.raw_output_contents[0], np.float32), _scores(IMAGES[:1])[0], rtol=1e-5
    )


def _parse_image_model(metadata: Any, config: Any) -> tuple[int, str, str, int, Any]:
    """image_client's parse_model: one input of 3 dimensions besides the batch, NCHW or NHWC; one FP32
    output."""
    assert len(metadata.inputs) == 1 and len(metadata.outputs) == 1 and len(config.input) == 1
    assert metadata.outputs[0].datatype == "FP32"
    fmt = config.input[0].format
    if isinstance(fmt, str):  # HTTP's JSON names the enum
        fmt = dict(mc.ModelInput.Format.items())[fmt]
    assert fmt in (mc.ModelInput.FORMAT_NCHW, mc.ModelInput.FORMAT_NHWC)
    assert len(metadata.inputs[0].shape) == 3 + (config.max_batch_size > 0)
    return (
        config.max_batch_size,
        metadata.inputs[0].name,
        metadata.outputs[0].name,
        fmt,
        metadata.inputs[0].datatype,
    )


class _Fields:
    """HTTP's JSON answers read with attributes, as image_client reads them through AttrDict."""

    def __init__(self, value: dict[str, Any]) -> None:
        for key, item in value.items():
            setattr(
                self,
                key,
                [_Fields(i) if isinstance(i, dict) else i for i in item] if isinstance(item, list) else item,
            )


@pytest.mark.parametrize("mode", ["http", "http_async", "grpc", "grpc_async", "grpc_streaming"])
def test_image_client(daemon: RunningDaemon, mode: str) -> None:
    """image_client (-i http|grpc, -a, --streaming, -b 2 -c 3): the model's metadata and config parsed as the
    client does, then batches of images, each answered with its top classes as "value:index:label"."""
    lib: Any = grpcclient if mode.startswith("grpc") else httpclient
    if lib is grpcclient:
        client = grpcclient.InferenceServerClient(daemon.address)
    else:
        client = httpclient.InferenceServerClient(daemon.http_address, concurrency=20)
    metadata, config = client.get_model_metadata("classifier"), client.get_model_config("classifier")
    if lib is grpcclient:
        config = config.config
    else:
        metadata, config = _Fields(metadata), _Fields(config)
    max_batch_size, input_name, output_name, fmt, datatype = _parse_image_model(metadata, config)
    assert (max_batch_size, fmt, datatype) == (8, mc.ModelInput.FORMAT_NCHW, "FP32")
    batches = [IMAGES[0:2], np.stack([IMAGES[2], IMAGES[0]])]
    answers: queue.Queue[Any] = queue.Queue()
    if mode == "grpc_streaming":
        client.start_stream(lambda result, error: answers.put(error or result))
    pending = []
    for index, batch in enumerate(batches):
        inputs = [lib.InferInput(input_name, list(batch.shape), datatype)]
        inputs[0].set_data_from_numpy(batch)
        outputs = [lib.InferRequestedOutput(output_name, class_count=3)]
        request = {"request_id": str(index + 1), "outputs": outputs}
        if mode == "grpc_streaming":
            client.async_stream_infer("classifier", inputs, **request)
        elif mode == "grpc_async":
            client.async_infer(
                "classifier", inputs, lambda result, error: answers.put(error or result), **request
            )
        elif mode == "http_async":
            pending.append(client.async_infer("classifier", inputs, **request))
        else:
            answers.put(client.infer("classifier", inputs, **request))
    results = [r.get_result() for r in pending] or [answers.get(timeout=30) for _ in batches]
    if mode == "grpc_streaming":
        client.stop_stream()
    by_id = {}
    for result in results:
        response = result.get_response()
        by_id[response.id if lib is grpcclient else response["id"]] = result.as_numpy(output_name)
    for index, batch in enumerate(batches):
        classes = by_id[str(index + 1)]
        assert classes.shape == (2, 3)
        assert [[c.decode() for c in row] for row in classes] == _top(batch, 3)


@pytest.mark.parametrize("streaming", [False, True])
def test_grpc_image_client(daemon: RunningDaemon, streaming: bool) -> None:
    """grpc_image_client: the bare stub, the classification parameter set by hand (int64_param), one image
    after another as raw bytes, by ModelInfer or one ModelStreamInfer."""
    stub = _stub(daemon)

    def requests() -> Iterator[Any]:
        for image in IMAGES:
            request = service_pb2.ModelInferRequest(model_name="classifier", model_version="")
            output = service_pb2.ModelInferRequest.InferRequestedOutputTensor(name="fc6_1")
            output.parameters["classification"].int64_param = 2
            request.outputs.append(output)
            request.inputs.append(
                service_pb2.ModelInferRequest.InferInputTensor(
                    name="data_0", datatype="FP32", shape=[1, 3, 8, 8]
                )
            )
            request.raw_input_contents.append(image.tobytes())
            yield request

    if streaming:
        streamed = list(stub.ModelStreamInfer(requests()))
        assert [r.error_message for r in streamed] == [""] * len(IMAGES)
        responses = [r.infer_response for r in streamed]
    else:
        responses = [stub.ModelInfer(r) for r in requests()]
    for image, response in zip(IMAGES, responses, strict=True):
        assert len(response.outputs) == 1 and len(response.raw_output_contents) == 1
        classes = deserialize_bytes_tensor(response.raw_output_contents[0]).reshape(
            list(response.outputs[0].shape)
        )
        assert [[c.decode() for c in row] for row in classes] == _top(image[None], 2)


# `simple`'s whole config as a load's `config` override, its batch size raised to 16. Triton's examples send
# `{"max_batch_size": "16"}` alone, which Triton completes from the model file and mpsd from the model's
# repository config: the test sends both.
OVERRIDE = json.dumps(
    {
        "platform": "pytorch_libtorch",
        "max_batch_size": "16",
        "input": _io(["INPUT0", "INPUT1"], "TYPE_INT32", [16]),
        "output": _io(["OUTPUT0", "OUTPUT1"], "TYPE_INT32", [16]),
    }
)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_model_control(daemon: RunningDaemon, protocol: str) -> None:
    """simple_grpc_model_control and simple_http_model_control: the repository index, load, a malformed
    config refused with "failed to load", a config override whose max_batch_size ModelConfig then reports,
    unload, an oversized file path refused with Triton's INTERNAL `failed to poll from model repository`,
    the server still live, an unknown model's "failed to load"; then `simple` loaded again from the
    repository for the other tests, its own config back."""
    lib: Any = grpcclient if protocol == "grpc" else httpclient
    client = lib.InferenceServerClient(daemon.address if protocol == "grpc" else daemon.http_address)

    def max_batch_size() -> int:
        config = client.get_model_config("simple")
        return int(config.config.max_batch_size if protocol == "grpc" else config["max_batch_size"])

    index = client.get_model_repository_index()
    assert len(index.models if protocol == "grpc" else index) == 6
    client.load_model("simple")
    assert client.is_model_ready("simple")
    try:
        with pytest.raises(InferenceServerException) as info:
            client.load_model("simple", config='"parameters": {"config": {{"max_batch_size": "16"}}}')
        assert "failed to load" in info.value.message()
        client.load_model("simple", config=OVERRIDE)
        assert max_batch_size() == 16
        client.load_model("simple", config=json.dumps({"max_batch_size": "16"}))  # the example's own
        assert max_batch_size() == 16
        client.unload_model("simple")
        assert not client.is_model_ready("simple")
        with pytest.raises(InferenceServerException) as info:
            client.load_model("simple", config="{}", files={"file:" + "A" * 256: b"a"})
        assert info.value.status() == ("StatusCode.INTERNAL" if protocol == "grpc" else "500")
        assert "failed to poll from model repository" in info.value.message()
        assert client.is_server_live()
        with pytest.raises(InferenceServerException) as info:
            client.load_model("wrong_model_name")
        assert "failed to load" in info.value.message()
    finally:
        client.load_model("simple")
    assert client.is_model_ready("simple") and max_batch_size() == 8
