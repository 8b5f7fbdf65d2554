"""OpenAI's API as docs/openai.md gives its refusals and fields, at the functions that decide them:
one choice per request, no log probabilities, at most 2048 texts an embeddings request, the `code` of each
error, and a streamed chunk's `usage` under `include_usage`. The wire, with OpenAI's own client, is
test_openai.py's."""

from __future__ import annotations

from typing import Any

import pytest

from mpsd.config.model_schema import OpenAIConfig
from mpsd.daemon.api.openai.embeddings import texts_of
from mpsd.daemon.api.openai.errors import error_dict
from mpsd.daemon.api.openai.generation import Reply, _check_one_choice
from mpsd.errors import DeadlineExceeded, InvalidField, PermissionDenied, Unavailable


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"n": 2}, "n"),
        ({"best_of": 3}, "best_of"),
        ({"logprobs": True}, "logprobs"),
        ({"logprobs": 0}, "logprobs"),  # completions' count of log probabilities: 0 still asks for some
        ({"logprobs": 2}, "logprobs"),
        ({"top_logprobs": 2}, "logprobs"),
    ],
)
def test_a_second_choice_or_log_probabilities_are_refused_naming_the_field(
    body: dict[str, Any], param: str
) -> None:
    with pytest.raises(InvalidField) as refused:
        _check_one_choice(body)
    assert refused.value.param == param


def test_one_choice_and_no_log_probabilities_pass() -> None:
    for body in ({}, {"n": 1, "best_of": 1}, {"logprobs": False}, {"logprobs": None, "top_logprobs": None}):
        _check_one_choice(body)


def test_an_embeddings_request_takes_at_most_2048_texts() -> None:
    section = OpenAIConfig(task="embeddings", input="TEXT", output="EMBEDDING")
    assert len(texts_of(["a"] * 2048, section, "m")[0]) == 2048
    with pytest.raises(InvalidField, match="2049 items; at most 2048") as refused:
        texts_of(["a"] * 2049, section, "m")
    assert refused.value.param == "input"


@pytest.mark.parametrize(
    ("status", "error", "kind", "code"),
    [
        (403, PermissionDenied("no"), "invalid_request_error", "permission_denied"),
        (503, Unavailable("no"), "server_error", "service_unavailable"),
        (504, DeadlineExceeded("no"), "server_error", "timeout"),
    ],
)
def test_each_error_has_the_type_and_code_the_table_gives(
    status: int, error: Any, kind: str, code: str
) -> None:
    assert error_dict(status, "no", error) == {"message": "no", "type": kind, "param": None, "code": code}


def test_with_include_usage_every_chunk_says_usage_null_and_without_it_none_does() -> None:
    """OpenAI's own client reads a missing `usage` as null: only the body itself tells them apart."""
    with_usage, without = Reply(True, "m").chunk("a", None, True), Reply(True, "m").chunk("a", None, False)
    assert "usage" in with_usage and with_usage["usage"] is None
    assert "usage" not in without
