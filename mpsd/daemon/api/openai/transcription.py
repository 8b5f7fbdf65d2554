"""`POST /v1/audio/transcriptions`: a multipart upload of an audio file, whose bytes the model takes as its
`openai.input` (decoding and resampling are the model's); its other form fields (`language`, `prompt`,
`temperature`, ...) are its request parameters. The model's text output (a decoupled model's pieces,
joined) is answered as `json`, `text`, `verbose_json`, `srt` or `vtt`.

The upload is held to the request-size limit as it is read, the declared length first. The duration in
`verbose_json`, `srt` and `vtt` is read from a WAV file's header (0 for other formats).
"""

from __future__ import annotations

import contextlib
import io
import wave
from typing import Any

from aiohttp import BodyPartReader, web

from mpsd.daemon.api.operations import Operations
from mpsd.daemon.api.tracing import came_over_http
from mpsd.daemon.api.web import method, too_large
from mpsd.errors import InvalidArgument, InvalidField
from mpsd.net.auth import OPENAI

from .calls import TextPieces, answers, output, text_call, texts_of
from .fields import dumps, passed_on, target
from .stats import MODEL_KEY, OpenAIStats, counted

FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
USED = frozenset({"model", "file", "response_format", "stream"})
NUMBERS = frozenset({"temperature"})


async def read_form(request: web.Request, limit: int) -> tuple[dict[str, Any], bytes | None]:
    """The form's fields (`name[]` fields as lists) and the file's bytes, within `limit` bytes in all."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise too_large(declared, limit)
    if not request.content_type.startswith("multipart/"):
        raise InvalidArgument("the request must be multipart/form-data, with the audio file as `file`")
    fields: dict[str, Any] = {}
    audio: bytes | None = None
    received = 0
    reader = await request.multipart()
    while (part := await reader.next()) is not None:
        if not isinstance(part, BodyPartReader) or not part.name:
            raise InvalidArgument("a form part without a name")
        data = bytearray()
        while chunk := await part.read_chunk():
            received += len(chunk)
            if received > limit:
                raise too_large(None, limit)
            data += chunk
        if part.name == "file":
            audio = bytes(data)
            continue
        try:
            value = data.decode()
        except UnicodeDecodeError:
            raise InvalidField(part.name, f"form field '{part.name}' is not UTF-8 text") from None
        if part.name.endswith("[]"):
            fields.setdefault(part.name[:-2], []).append(value)
        else:
            fields[part.name] = _typed(part.name, value)
    return fields, audio


def _typed(name: str, value: str) -> Any:
    if name not in NUMBERS:
        return value
    try:
        return float(value)
    except ValueError:
        raise InvalidField(name, f"'{name}' must be a number") from None


def wav_seconds(audio: bytes) -> float:
    """A WAV file's duration from its header; 0 for anything else."""
    try:
        with wave.open(io.BytesIO(audio)) as wav:
            return float(wav.getnframes() / wav.getframerate())
    except (wave.Error, EOFError, ValueError, ZeroDivisionError):
        return 0.0


def _clock(seconds: float, point: str) -> str:
    ms = round(seconds * 1000)
    return f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}{point}{ms % 1000:03d}"


def answer(text: str, form: str, seconds: float, language: str) -> web.Response:
    if form == "text":
        return web.Response(text=text, content_type="text/plain")
    if form == "srt":
        return web.Response(
            text=f"1\n00:00:00,000 --> {_clock(seconds, ',')}\n{text}\n\n", content_type="text/plain"
        )
    if form == "vtt":
        cue = f"00:00:00.000 --> {_clock(seconds, '.')}\n{text}\n\n"
        return web.Response(text="WEBVTT\n\n" + cue, content_type="text/vtt")
    body: dict[str, Any] = {"text": text}
    if form == "verbose_json":
        body = {"task": "transcribe", "language": language, "duration": seconds, "text": text}
    body["usage"] = {"type": "duration", "seconds": seconds}
    return web.Response(body=dumps(body), content_type="application/json")


class TranscriptionHandler:
    def __init__(self, ops: Operations, limit: int, stats: OpenAIStats) -> None:
        self.ops = ops
        self.limit = limit
        self.stats = stats

    @method(OPENAI + "Transcriptions")
    @counted("audio.transcriptions")
    async def create(self, request: web.Request) -> web.StreamResponse:
        came = came_over_http(request.headers, "OpenAI transcriptions") if self.ops.tracing.on else None
        fields, audio = await read_form(request, self.limit)
        name, config, section = target(self.ops, fields, "transcription")
        request[MODEL_KEY] = name
        if audio is None:
            raise InvalidField("file", "'file' is required: the audio file, as a multipart upload")
        form = fields.get("response_format", "json")
        if form not in FORMATS:
            raise InvalidField("response_format", f"'response_format' must be one of {', '.join(FORMATS)}")
        if fields.get("stream") not in (None, "false", "False"):
            raise InvalidField("stream", "transcriptions are not streamed: leave 'stream' out")
        rest = passed_on(fields, USED, section, name, response_format=form)
        call = text_call(name, config, section, [audio], rest)
        responses = answers(self.ops, call, config.model_transaction_policy.decoupled, came)
        pieces, text = TextPieces(), []
        try:
            async for answered in responses:
                text.append(pieces.add(b"".join(texts_of(output(answered.result, section.output)))))
        finally:
            with contextlib.suppress(Exception):
                await responses.aclose()
        text.append(pieces.end())
        language = fields.get("language") or "unknown"
        return answer("".join(text), form, wav_seconds(audio), str(language))
