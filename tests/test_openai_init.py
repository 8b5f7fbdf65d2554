"""`mpsd init-model --openai`: from a Hugging Face model folder to an OpenAI endpoint in one command. The
folders are real (a WordPiece tokenizer and a small BERT; a word-level tokenizer with a chat template and a
small GPT-2, random weights, built here); the written models serve, through the official `openai` client,
what transformers computes from the same folders in this process, and the chat model's stream never shows
a stop string that spans two tokens."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import torch
import yaml

from tests import text_models
from tests.conftest import ROOT, RunningDaemon

SENTENCES = ["the lazy dog sleeps", "a model server for pytorch", "zyzzyva"]
MESSAGES = [{"role": "user", "content": "the quick brown fox"}]


@dataclass
class Written:
    daemon: RunningDaemon
    bert: Path
    gpt: Path
    client: openai.OpenAI
    sbert: Path


MAX_SEQ_LENGTH = 8  # sentence_bert_config.json's, below the tokenizer's and the model's own limits


def sentence_transformers_folder(bert: Path, folder: Path) -> None:
    """`bert` laid out as sentence-transformers saves a model: modules.json naming the Transformer (the
    folder itself), a Pooling of the CLS token and the max over tokens, and a Normalize."""
    import json
    import shutil

    shutil.copytree(bert, folder)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": MAX_SEQ_LENGTH, "do_lower_case": False})
    )
    (folder / "1_Pooling").mkdir()
    pooling = {
        f"pooling_mode_{m}": False for m in ("mean_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens")
    }
    pooling |= {"word_embedding_dimension": text_models.HIDDEN, "pooling_mode_cls_token": True}
    pooling |= {"pooling_mode_max_tokens": True, "pooling_mode_lasttoken": False, "include_prompt": True}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (folder / "2_Normalize").mkdir()


INIT_MODEL = (sys.executable, "-m", "mpsd", "init-model")


def init_model(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*INIT_MODEL, *args], capture_output=True, text=True, timeout=300, cwd=ROOT)


def init_model_started(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*INIT_MODEL, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
    )


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Written]:
    tmp = tmp_path_factory.mktemp("openai-init")
    bert, gpt, repo, sbert = tmp / "bert", tmp / "gpt", tmp / "repo", tmp / "sbert"
    text_models.build(bert)
    text_models.for_auto_classes(bert)
    text_models.causal_lm(gpt)
    sentence_transformers_folder(bert, sbert)
    # The three commands run at once, each staging its model apart and renaming it into the repository:
    # most of each one's time is its own interpreter importing torch and transformers.
    commands = [
        (task, init_model_started(name, "--openai", task, "--from", str(folder), "--repository", str(repo)))
        for name, task, folder in (
            ("minilm", "embeddings", bert),
            ("assistant", "chat", gpt),
            ("sbert", "embeddings", sbert),
        )
    ]
    try:
        for task, command in commands:
            stdout, stderr = command.communicate(timeout=300)
            assert command.returncode == 0, stderr
            assert f"openai: {{task: {task}" in stdout or f"task: {task}" in stdout
    finally:
        for _, command in commands:
            if command.poll() is None:
                command.kill()
                command.wait()
    daemon = RunningDaemon(repo, tmp / "daemon.log")
    try:
        daemon.wait_ready(timeout=300)
        with openai.OpenAI(base_url=f"http://{daemon.http_address}/v1", api_key="-") as client:
            yield Written(daemon, bert, gpt, client, sbert)
    finally:
        daemon.stop()
        daemon.kill_group()


def test_an_embeddings_model_from_a_folder_serves_what_transformers_computes(written: Written) -> None:
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(written.bert)
    network = AutoModel.from_pretrained(written.bert).eval()
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.inference_mode():
        hidden = network(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    expected = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=1).numpy()
    answer = written.client.embeddings.create(model="minilm", input=SENTENCES)
    np.testing.assert_allclose([d.embedding for d in answer.data], expected, rtol=1e-4, atol=1e-5)
    assert answer.usage.prompt_tokens == int(batch["attention_mask"].sum())
    config = yaml.safe_load((written.daemon.repo / "minilm" / "config.yaml").read_text())
    assert config["output"][0]["dims"] == [text_models.HIDDEN]  # from the folder's config.json


def test_a_sentence_transformers_folder_is_cut_and_pooled_as_its_configuration_says(written: Written) -> None:
    """Its max_seq_length (8) cuts a long text, not the tokenizer's limit; CLS and max pooling concatenated
    and scaled to unit length, as its modules say: the reference is computed here with transformers."""
    from transformers import AutoModel, AutoTokenizer

    long_text = " ".join(["the lazy dog sleeps and a model server for pytorch"] * 4)
    texts = [long_text, "zyzzyva"]
    tokenizer = AutoTokenizer.from_pretrained(written.sbert)
    assert len(tokenizer(long_text)["input_ids"]) > MAX_SEQ_LENGTH < tokenizer.model_max_length
    network = AutoModel.from_pretrained(written.sbert).eval()
    batch = tokenizer(texts, padding=True, truncation=True, max_length=MAX_SEQ_LENGTH, return_tensors="pt")
    with torch.inference_mode():
        hidden = network(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1)
    cls, top = hidden[:, 0], hidden.masked_fill(mask == 0, -1e9).max(1).values
    expected = torch.nn.functional.normalize(torch.cat([cls, top], dim=1), dim=1).numpy()
    answer = written.client.embeddings.create(model="sbert", input=texts)
    np.testing.assert_allclose([d.embedding for d in answer.data], expected, rtol=1e-4, atol=1e-5)
    assert answer.usage.prompt_tokens == MAX_SEQ_LENGTH + int(batch["attention_mask"][1].sum())
    config = yaml.safe_load((written.daemon.repo / "sbert" / "config.yaml").read_text())
    assert config["output"][0]["dims"] == [2 * text_models.HIDDEN]  # two pooling modes of 1_Pooling


def _greedy(folder: Path, messages: list[dict[str, Any]], tokens: int) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    network = AutoModelForCausalLM.from_pretrained(folder).eval()
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    out = network.generate(ids, max_new_tokens=tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return str(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))


def test_a_chat_model_from_a_folder_streams_what_transformers_generates(written: Written) -> None:
    client = written.client
    expected = _greedy(written.gpt, MESSAGES, 8)
    assert expected
    whole = client.chat.completions.create(model="assistant", messages=MESSAGES, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    assert whole.choices[0].message.content == expected
    assert whole.usage is not None and whole.usage.completion_tokens <= 8
    stream = client.chat.completions.create(
        model="assistant",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
        stream=True,
    )
    chunks = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(chunks) == expected and len([c for c in chunks if c]) > 1
    sampled = [
        client.chat.completions.create(model="assistant", messages=MESSAGES, max_tokens=8, seed=7)  # type: ignore[arg-type]
        .choices[0]
        .message.content
        for _ in range(2)
    ]
    assert sampled[0] == sampled[1]  # the seed reached the model
    words = expected.split()
    stopped = client.chat.completions.create(
        model="assistant",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
        stop=[words[-1]],
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert words[-1] not in (stopped.choices[0].message.content or "")


def test_init_model_refuses_what_does_not_apply(tmp_path: Path) -> None:
    done = init_model("x", "--openai", "chat", "--from", str(tmp_path), "--repository", str(tmp_path / "r"))
    assert done.returncode != 0 and "no config.json" in done.stderr
    done = init_model("x", "--openai", "chat", "--from", str(tmp_path), "--aoti", "cpu")
    assert done.returncode != 0 and "--aoti" in done.stderr


STOP_TOKENS = 10


def test_a_stop_string_across_two_tokens_is_never_streamed(written: Written) -> None:
    """Streamed from the chat model: the text that may begin a stop string is held back until the next
    token says whether it does, so no part of the stop string is ever streamed, and the answer ends right
    before it with finish_reason "stop"."""
    client = written.client
    expected = _greedy(written.gpt, MESSAGES, STOP_TOKENS)
    words = expected.split(" ")
    assert len(words) >= 6, expected
    stop = words[3] + " " + words[4]  # two words: two tokens of the word-level tokenizer
    before = expected[: expected.index(stop)]
    stream = client.chat.completions.create(
        model="assistant",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=STOP_TOKENS,
        temperature=0,
        stop=[stop],
        stream=True,
    )
    chunks = [c.choices[0] for c in stream if c.choices]
    streamed = "".join(c.delta.content or "" for c in chunks)
    assert streamed == before, (streamed, stop)
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["stop"]
