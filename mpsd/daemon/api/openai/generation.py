"""`POST /v1/chat/completions` and `POST /v1/completions` on a model that generates text, most usefully a
decoupled one that yields its text piece by piece.

The model's `openai.input` gets the chat's `messages` as JSON (chat) or the prompt (completions), and its
request parameters the request's other fields (`max_tokens`, `temperature`, `stop`, `seed`, ...), which the
model applies. Each response's `openai.output` is the next piece of text;
`finish_reason_output` says why generation ended, `usage_output` counts tokens. With `stream: true` each
piece is sent as it comes, as server-sent events in OpenAI's chunk format ending with `data: [DONE]`;
without, the answer is assembled from the same responses. A client that goes away closes the model's
generator at its next response (`Operations.stream`).
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, Mapping
from typing import Any

from aiohttp import web

from mpsd.config.model_config import OpenAIConfig
from mpsd.daemon.api.operations import Answered, Operations
from mpsd.daemon.api.tracing import came_over_http
from mpsd.daemon.api.web import method
from mpsd.errors import InvalidField, MpsdError
from mpsd.net.auth import OPENAI
from mpsd.net.status import http_status

from .calls import TextPieces, answers, integers, output, text_call, texts_of
from .errors import error_dict
from .fields import boolean, dumps, json_body, passed_on, target
from .stats import FAILED_KEY, MODEL_KEY, OpenAIStats, counted

JSON = "application/json"
SSE = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
DONE = b"data: [DONE]\n\n"
CHAT_USED = frozenset({"model", "messages", "stream", "stream_options", "n"})
COMPLETIONS_USED = frozenset({"model", "prompt", "stream", "stream_options", "n", "echo", "best_of"})


class Progress:
    """What a request's responses have said so far: the text, why it ended, the tokens counted."""

    def __init__(self, section: OpenAIConfig) -> None:
        self.section = section
        self.pieces = TextPieces()
        self.text: list[str] = []
        self.finish: str | None = None
        self.usage: tuple[int, int] | None = None
        self.responses = 0

    def take(self, answered: Answered) -> str:
        """The new text of one response."""
        result, section = answered.result, self.section
        data = b"".join(texts_of(output(result, section.output)))
        if data:
            self.responses += 1
        if section.finish_reason_output is not None:
            reason = b"".join(texts_of(output(result, section.finish_reason_output))).decode(
                "utf-8", "replace"
            )
            self.finish = reason or self.finish
        if section.usage_output is not None:
            counts = integers(output(result, section.usage_output))
            if len(counts) >= 2:
                self.usage = (counts[0], counts[1])
        piece = self.pieces.add(data)
        self.text.append(piece)
        return piece

    def end(self) -> str:
        piece = self.pieces.end()
        self.text.append(piece)
        return piece

    def usage_dict(self) -> dict[str, int]:
        prompt, completion = self.usage if self.usage is not None else (0, self.responses)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def messages_of(body: Mapping[str, Any]) -> bytes:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidField("messages", "'messages' must be a non-empty array of messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidField(f"messages[{i}]", f"'messages[{i}]' must be an object with a 'role' string")
    return dumps(messages)


def prompt_of(body: Mapping[str, Any]) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise InvalidField("prompt", "'prompt' must be a string (one prompt per request; no token arrays)")
    return prompt


def _check_one_choice(body: Mapping[str, Any]) -> None:
    for key in ("n", "best_of"):
        value = body.get(key)
        if value is not None and value != 1:
            raise InvalidField(key, f"'{key}' must be 1: each request gets one choice")
    logprobs = body.get("logprobs")  # `is`, not `in`: 0 == False, and completions' logprobs: 0 asks for some
    if (logprobs is not None and logprobs is not False) or body.get("top_logprobs") is not None:
        raise InvalidField("logprobs", "log probabilities are not given: the model answers with text")


def _include_usage(body: Mapping[str, Any]) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise InvalidField("stream_options", "'stream_options' must be an object")
    return boolean(options, "include_usage")


class Reply:
    """One request's answer in OpenAI's objects: chat's or completions'."""

    def __init__(self, chat: bool, name: str, echo: str = "") -> None:
        self.chat = chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = name
        self.echo = echo  # completions' `echo`: the prompt before the text

    def _head(self, chunk: bool) -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        kind += ".chunk" if chunk and self.chat else ""
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def chunk(self, piece: str | None, finish: str | None, usage: bool) -> dict[str, Any]:
        """A streamed chunk: a piece of text (None: the first chat chunk, naming the role), or the end."""
        if self.chat:
            delta = (
                {"role": "assistant", "content": ""} if piece is None else {"content": piece} if piece else {}
            )
            choice: dict[str, Any] = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": piece or ""}
        choice.update(logprobs=None, finish_reason=finish)
        return {**self._head(True), "choices": [choice], **({"usage": None} if usage else {})}

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        return {**self._head(True), "choices": [], "usage": usage}

    def whole(self, text: str, finish: str, usage: dict[str, int]) -> dict[str, Any]:
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": self.echo + text}
        choice.update(logprobs=None, finish_reason=finish)
        return {**self._head(False), "choices": [choice], "usage": usage}


def event(value: Any) -> bytes:
    return b"data: " + dumps(value) + b"\n\n"


class GenerationHandler:
    def __init__(self, ops: Operations, limit: int, stats: OpenAIStats) -> None:
        self.ops = ops
        self.limit = limit
        self.stats = stats

    @method(OPENAI + "ChatCompletions")
    @counted("chat.completions")
    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, True)

    @method(OPENAI + "Completions")
    @counted("completions")
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, False)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        name = "OpenAI chat" if chat else "OpenAI completions"
        came = came_over_http(request.headers, name) if self.ops.tracing.on else None
        body = await json_body(request, self.limit)
        name, config, section = target(self.ops, body, "chat" if chat else "completions")
        request[MODEL_KEY] = name
        echo = ""
        if chat:
            text = messages_of(body)
        else:
            prompt = prompt_of(body)
            text, echo = prompt.encode(), prompt if boolean(body, "echo") else ""
        _check_one_choice(body)
        streamed, include_usage = boolean(body, "stream"), _include_usage(body)
        rest = passed_on(body, CHAT_USED if chat else COMPLETIONS_USED, section, name)
        call = text_call(name, config, section, [text], rest)
        responses = answers(self.ops, call, config.model_transaction_policy.decoupled, came)
        reply, progress = Reply(chat, name, echo), Progress(section)
        try:
            if streamed:
                return await self._stream(request, responses, reply, progress, include_usage)
            async for answered in responses:
                progress.take(answered)
            progress.end()
        finally:
            with contextlib.suppress(Exception):
                await responses.aclose()
        answer = reply.whole("".join(progress.text), progress.finish or "stop", progress.usage_dict())
        return web.Response(body=dumps(answer), content_type=JSON)

    async def _stream(
        self,
        request: web.Request,
        responses: AsyncGenerator[Answered, None],
        reply: Reply,
        progress: Progress,
        include_usage: bool,
    ) -> web.StreamResponse:
        """Server-sent events from the first response on; an error before it is an ordinary HTTP error, one
        after it a last event `data: {"error": {...}}`, as OpenAI sends it."""
        stream = web.StreamResponse(headers=SSE)
        started = False

        async def start() -> None:
            nonlocal started
            started = True
            await stream.prepare(request)
            if reply.chat:
                await stream.write(event(reply.chunk(None, None, include_usage)))
            elif reply.echo:
                await stream.write(event(reply.chunk(reply.echo, None, include_usage)))

        try:
            async for answered in responses:
                piece = progress.take(answered)
                if not started:
                    await start()
                if piece:
                    await stream.write(event(reply.chunk(piece, None, include_usage)))
            if not started:
                await start()
            tail = progress.end()
            if tail:
                await stream.write(event(reply.chunk(tail, None, include_usage)))
            await stream.write(event(reply.chunk("", progress.finish or "stop", include_usage)))
            if include_usage:
                await stream.write(event(reply.usage_chunk(progress.usage_dict())))
            await stream.write(DONE)
        except MpsdError as exc:
            if not started:
                raise
            request[FAILED_KEY] = exc  # counted with its error's status, though the stream began with 200
            await stream.write(event({"error": error_dict(int(http_status(exc)), exc.message, exc)}))
        await stream.write_eof()
        return stream
