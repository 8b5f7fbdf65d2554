"""A stop string that spans two tokens, streamed through the official `openai` client from a chat model
written by `mpsd init-model --openai chat` (a small GPT-2 with a word-level tokenizer, built here): the
text that may begin a stop string is held back until the next token says whether it does, so no part of
the stop string is ever streamed, and the answer ends right before it with finish_reason "stop"."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests import text_models
from tests.conftest import RunningDaemon
from tests.test_openai_init import MESSAGES, _greedy, init_model

TOKENS = 10


@pytest.fixture(scope="module")
def chat(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[openai.OpenAI, Path]]:
    tmp = tmp_path_factory.mktemp("openai-stop")
    gpt, repo = tmp / "gpt", tmp / "repo"
    text_models.causal_lm(gpt)
    done = init_model("assistant", "--openai", "chat", "--from", str(gpt), "--repository", str(repo))
    assert done.returncode == 0, done.stderr
    daemon = RunningDaemon(repo, tmp / "daemon.log")
    try:
        daemon.wait_ready(timeout=300)
        with openai.OpenAI(base_url=f"http://{daemon.http_address}/v1", api_key="-") as client:
            yield client, gpt
    finally:
        daemon.stop()
        daemon.kill_group()


def test_a_stop_string_across_two_tokens_is_never_streamed(chat: tuple[openai.OpenAI, Path]) -> None:
    client, folder = chat
    expected = _greedy(folder, MESSAGES, TOKENS)
    words = expected.split(" ")
    assert len(words) >= 6, expected
    stop = words[3] + " " + words[4]  # two words: two tokens of the word-level tokenizer
    before = expected[: expected.index(stop)]
    stream = client.chat.completions.create(
        model="assistant",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=TOKENS,
        temperature=0,
        stop=[stop],
        stream=True,
    )
    chunks = [c.choices[0] for c in stream if c.choices]
    streamed = "".join(c.delta.content or "" for c in chunks)
    assert streamed == before, (streamed, stop)
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["stop"]
