"""The paths of OpenAI's API the daemon serves, as a `Mount` on its HTTP server: everything under `/v1/`
answers errors in OpenAI's body (`errors`), access and size limits included."""

from __future__ import annotations

import time

from aiohttp import web

from mpsd.daemon.api.operations import Operations
from mpsd.daemon.api.web import ExpectHandler, Mount

from .embeddings import EmbeddingsHandler
from .errors import openai_error
from .generation import GenerationHandler
from .models import ModelsHandler
from .stats import OpenAIStats
from .transcription import TranscriptionHandler

PREFIX = "/v1/"


def openai_mount(ops: Operations, limit: int, stats: OpenAIStats) -> Mount:
    """OpenAI's API over `ops`; request bodies over `limit` bytes are refused (413) before they are read."""
    models = ModelsHandler(ops, stats, int(time.time()))
    embeddings = EmbeddingsHandler(ops, limit, stats)
    generation = GenerationHandler(ops, limit, stats)
    transcription = TranscriptionHandler(ops, limit, stats)

    def add_routes(app: web.Application, expect: ExpectHandler) -> None:
        app.router.add_get("/v1/models", models.list, allow_head=False)
        app.router.add_get("/v1/models/{model}", models.retrieve, allow_head=False)
        for path, handler in (
            ("/v1/embeddings", embeddings.create),
            ("/v1/chat/completions", generation.chat),
            ("/v1/completions", generation.completions),
            ("/v1/audio/transcriptions", transcription.create),
        ):
            app.router.add_post(path, handler, expect_handler=expect)

    return Mount(PREFIX, add_routes, openai_error)
