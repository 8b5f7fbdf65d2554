"""`mpsd init-model --openai`: from a Hugging Face model folder to an OpenAI endpoint in one command. The
folders are real (a WordPiece tokenizer and a small BERT; a word-level tokenizer with a chat template and a
small GPT-2, random weights, built here); the written models serve, through the official `openai` client,
what transformers computes from the same folders in this process."""

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


def init_model(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mpsd", "init-model", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Written]:
    tmp = tmp_path_factory.mktemp("openai-init")
    bert, gpt, repo = tmp / "bert", tmp / "gpt", tmp / "repo"
    text_models.build(bert)
    text_models.for_auto_classes(bert)
    text_models.causal_lm(gpt)
    for name, task, folder in (("minilm", "embeddings", bert), ("assistant", "chat", gpt)):
        done = init_model(name, "--openai", task, "--from", str(folder), "--repository", str(repo))
        assert done.returncode == 0, done.stderr
        assert f"openai: {{task: {task}" in done.stdout or f"task: {task}" in done.stdout
    daemon = RunningDaemon(repo, tmp / "daemon.log")
    try:
        daemon.wait_ready(timeout=300)
        with openai.OpenAI(base_url=f"http://{daemon.http_address}/v1", api_key="-") as client:
            yield Written(daemon, bert, gpt, client)
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
