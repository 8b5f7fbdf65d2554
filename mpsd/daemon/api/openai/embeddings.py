"""`POST /v1/embeddings`: texts (or token arrays) in, one embedding per text out.

The texts become rows of the model's string input, as many per call as the model takes, the calls made at
once, so they batch with each other and with other requests (`dynamic_batching`). Embeddings come back as
JSON numbers (`encoding_format: float`) or as base64 of their little-endian float32 bytes (`base64`, what
OpenAI's Python library asks for unless told otherwise).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections.abc import Coroutine, Sequence
from typing import Any

import numpy as np
from aiohttp import web

from mpsd.config.model_config import OpenAIConfig
from mpsd.daemon.api.operations import Answered, Operations
from mpsd.daemon.api.tracing import came_over_http
from mpsd.daemon.api.web import method
from mpsd.errors import InvalidField
from mpsd.net.auth import OPENAI

from .calls import chunks, floats, integers, output, rows_per_call, text_call
from .fields import dumps, integer, json_body, passed_on, string, target
from .stats import MODEL_KEY, OpenAIStats, counted

USED = frozenset({"model", "input", "encoding_format", "dimensions"})
MAX_INPUTS = 2048  # OpenAI's limit on the texts of one request
JSON = "application/json"


def texts_of(value: Any, section: OpenAIConfig, name: str) -> tuple[list[bytes], bool]:
    """`input` as the rows for the model, and whether they are token arrays (as JSON text)."""
    if isinstance(value, str):
        return [value.encode()], False
    if not isinstance(value, list) or not value:
        raise InvalidField("input", "'input' must be a string, a non-empty array of strings, or token arrays")
    if len(value) > MAX_INPUTS:
        raise InvalidField("input", f"'input' has {len(value)} items; at most {MAX_INPUTS} are taken")
    if all(isinstance(v, str) for v in value):
        return [v.encode() for v in value], False
    arrays = [value] if all(_token(v) for v in value) else value
    if not all(isinstance(a, list) and a and all(_token(t) for t in a) for a in arrays):
        raise InvalidField("input", "'input' must be strings or arrays of token ids (integers), not a mix")
    if not section.tokens:
        raise InvalidField(
            "input",
            f"the model `{name}` takes text (its tokenizer is part of the model); "
            "its config's openai.tokens is not set, so token arrays are refused",
        )
    return [dumps(a) for a in arrays], True


def _token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_dimensions(dimensions: int | None, size: int, section: OpenAIConfig, name: str) -> None:
    """`dimensions` is the model's size, or fewer where openai.truncate_dimensions allows it."""
    if dimensions is None or dimensions == size or size < 0:
        return
    if not section.truncate_dimensions or dimensions > size:
        why = "fewer" if dimensions < size else "more"
        raise InvalidField(
            "dimensions",
            f"the model `{name}` gives {size} dimensions and cannot give {why} ({dimensions}): "
            "openai.truncate_dimensions lets a model trained for it be cut",
        )


def cut(matrix: np.ndarray[Any, Any], dimensions: int | None, section: OpenAIConfig, name: str) -> Any:
    """The embeddings with `dimensions` values each: as they are, or (openai.truncate_dimensions) their
    first values scaled back to unit length."""
    size = matrix.shape[1]
    check_dimensions(dimensions, size, section, name)
    if dimensions is None or dimensions == size:
        return matrix
    part = matrix[:, :dimensions]
    norms = np.linalg.norm(part, axis=1, keepdims=True)
    return part / np.where(norms > 0, norms, 1)


async def _all(calls: list[Coroutine[Any, Any, Answered]]) -> list[Answered]:
    """Every call's answer, the calls made at once; the first error once all have ended (none is left
    running, nor failing unseen)."""
    if len(calls) == 1:
        return [await calls[0]]
    answers = await asyncio.gather(*calls, return_exceptions=True)
    answered = [a for a in answers if not isinstance(a, BaseException)]
    for answer in answers:
        if isinstance(answer, BaseException):
            for done in answered:  # their traces end: no answer is written
                done.trace.end()
            raise answer
    return answered


class EmbeddingsHandler:
    def __init__(self, ops: Operations, limit: int, stats: OpenAIStats) -> None:
        self.ops = ops
        self.limit = limit
        self.stats = stats

    @method(OPENAI + "Embeddings")
    @counted("embeddings")
    async def create(self, request: web.Request) -> web.StreamResponse:
        came = came_over_http(request.headers, "OpenAI embeddings") if self.ops.tracing.on else None
        body = await json_body(request, self.limit)
        name, config, section = target(self.ops, body, "embeddings")
        request[MODEL_KEY] = name
        texts, tokens = texts_of(body.get("input"), section, name)
        encoding = string(body, "encoding_format", "float")
        if encoding not in ("float", "base64"):
            raise InvalidField("encoding_format", "'encoding_format' must be 'float' or 'base64'")
        dimensions = integer(body, "dimensions", 1)
        # refused before the model runs where its config gives the size (-1: once it has answered)
        check_dimensions(dimensions, config.output_by_name[section.output].dims[-1], section, name)
        parameters = passed_on(body, USED, section, name, input_type="tokens" if tokens else "text")
        parts = chunks(texts, rows_per_call(config, section))
        calls = [
            self.ops.infer(text_call(name, config, section, part, parameters), came=came) for part in parts
        ]
        answers = await _all(calls)
        with contextlib.ExitStack() as traces:  # each call's trace ends with the answer's writing
            for answered in answers:
                traces.enter_context(answered.trace.answering())
            return self._answer(answers, parts, section, name, dimensions, encoding)

    @staticmethod
    def _answer(
        answers: list[Answered],
        parts: list[Sequence[bytes]],
        section: OpenAIConfig,
        name: str,
        dimensions: int | None,
        encoding: str,
    ) -> web.Response:
        vectors, used = [], 0
        for part, answered in zip(parts, answers, strict=True):
            vectors.append(floats(output(answered.result, section.output), len(part)))
            if section.usage_output is not None:
                used += sum(integers(output(answered.result, section.usage_output)))
        matrix = cut(vectors[0] if len(vectors) == 1 else np.concatenate(vectors), dimensions, section, name)
        if encoding == "base64":
            rows: list[Any] = [base64.b64encode(r.astype("<f4").tobytes()).decode() for r in matrix]
        else:
            rows = matrix.tolist()
        answer = {
            "object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": r} for i, r in enumerate(rows)],
            "model": name,
            "usage": {"prompt_tokens": used, "total_tokens": used},
        }
        return web.Response(body=dumps(answer), content_type=JSON)
