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
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests import models
from tests.conftest import RunningDaemon

HIDDEN = 32
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a model server for pytorch on apple silicon",
    "strings in, embeddings out, batched by the daemon",
    "tokenizers train a vocabulary from a small corpus",
] * 8
SENTENCES = [
    "the lazy dog sleeps",
    "apple silicon serves pytorch models",
    "embeddings out",
    "an unseen wordpiece like zyzzyva",
    "",
]

# Shared by the served model and the in-process reference: the tokenizer and the network are the
# model's files, read from the folder they are given.
EMBED = """
import numpy as np
import torch
from tokenizers import Tokenizer
from transformers import BertModel


class Embedder:
    def __init__(self, folder):
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")
        self.network = BertModel.from_pretrained(str(folder)).eval()

    def __call__(self, texts):
        encoded = self.tokenizer.encode_batch([t.decode("utf-8") for t in texts])
        ids = torch.tensor([e.ids for e in encoded], dtype=torch.long)
        mask = torch.tensor([e.attention_mask for e in encoded], dtype=torch.long)
        with torch.inference_mode():
            hidden = self.network(input_ids=ids, attention_mask=mask).last_hidden_state
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1)
"""
MODEL_BODY = """
texts = inputs['TEXT'].reshape(-1)
return {'EMBEDDING': self.embed(texts)}
"""


def _build(folder: Path) -> None:
    """The tokenizer (trained on CORPUS) and the network (random weights, fixed seed) in `folder`."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors, trainers
    from tokenizers import models as tok_models
    from transformers import BertConfig, BertModel

    tokenizer = Tokenizer(tok_models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=200, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"])
    tokenizer.train_from_iterator(CORPUS, trainer)
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    BertModel(config).save_pretrained(str(folder))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningDaemon, Path]]:
    tmp = tmp_path_factory.mktemp("text")
    repo = tmp / "repo"
    model_dir = models.python_model(
        repo,
        "embedder",
        MODEL_BODY,
        config={
            "backend": "python",
            "max_batch_size": 8,
            "dynamic_batching": {"max_queue_delay_microseconds": 50_000},
            "input": [{"name": "TEXT", "data_type": "TYPE_STRING", "dims": [1]}],
            "output": [{"name": "EMBEDDING", "data_type": "TYPE_FP32", "dims": [HIDDEN]}],
            "instance_group": [{"kind": "KIND_CPU"}],
        },
    )
    folder = model_dir / "1"
    _build(folder)
    (folder / "embed.py").write_text(EMBED)
    source = (folder / "model.py").read_text()
    # The model imports its own helper from its folder and builds it once, at load.
    source = source.replace(
        "        self.device = device\n",
        "        self.device = device\n"
        "        import importlib.util, pathlib\n"
        "        folder = pathlib.Path(config['model_path']).parent\n"
        "        spec = importlib.util.spec_from_file_location('embed', folder / 'embed.py')\n"
        "        module = importlib.util.module_from_spec(spec)\n"
        "        spec.loader.exec_module(module)\n"
        "        self.embed = module.Embedder(folder)\n",
    )
    (folder / "model.py").write_text(source)
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
    namespace: dict[str, object] = {}
    exec(compile(EMBED, "embed.py", "exec"), namespace)
    embedder = namespace["Embedder"](folder)  # type: ignore[operator]
    return np.stack([embedder([s.encode()])[0].numpy() for s in sentences])


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
