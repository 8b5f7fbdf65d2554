"""A real text model served with strings in: a WordPiece tokenizer trained here with `tokenizers` and a small
BERT (random weights from a `transformers` config) inside a python model that takes sentences and returns
mean-pooled embeddings. Called with strings over gRPC and HTTP by the stock tritonclient, batched with
other requests by the daemon, its answers equal the same code run in this process."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests import text_models
from tests.conftest import RunningDaemon

SENTENCES = [
    "the lazy dog sleeps",
    "apple silicon serves pytorch models",
    "embeddings out",
    "an unseen wordpiece like zyzzyva",
    "",
]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningDaemon, Path]]:
    tmp = tmp_path_factory.mktemp("text")
    repo = tmp / "repo"
    folder = text_models.embedder(
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
    daemon = RunningDaemon(repo, tmp / "daemon.log")
    try:
        daemon.wait_models_settled(timeout=300)  # the worker imports transformers: seconds of CPU
        index = daemon.client.get_model_repository_index(as_json=True)["models"]
        assert [m["state"] for m in index] == ["READY"], index
        yield daemon, folder
    finally:
        daemon.stop()
        daemon.kill_group()


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
