"""`GET /v1/models` and `GET /v1/models/{model}`: the models whose config has an `openai` section, loaded
or not, in OpenAI's model object with what the daemon knows beside it (`task`, `state`)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from mpsd.config.model_config import ModelConfig
from mpsd.daemon.api.operations import Operations
from mpsd.daemon.api.web import method
from mpsd.errors import NotFound
from mpsd.net.auth import OPENAI

from .fields import ENDPOINTS, dumps
from .stats import MODEL_KEY, OpenAIStats, counted

JSON = "application/json"


class ModelsHandler:
    def __init__(self, ops: Operations, stats: OpenAIStats, created: int) -> None:
        self.ops = ops
        self.stats = stats
        self.created = created  # the daemon's start (Unix time): OpenAI's `created` of every model

    def _object(self, name: str, config: ModelConfig, state: str) -> dict[str, Any]:
        assert config.openai is not None
        task = config.openai.task
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "mpsd",
            "task": task,
            "endpoint": ENDPOINTS[task],
            "state": state,
        }

    @method(OPENAI + "ListModels")
    @counted("models")
    async def list(self, request: web.Request) -> web.StreamResponse:
        data = [self._object(*m) for m in self.ops.models() if m[1].openai is not None]
        return web.Response(body=dumps({"object": "list", "data": data}), content_type=JSON)

    @method(OPENAI + "ListModels")
    @counted("models")
    async def retrieve(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info.get("model", "")
        for model in self.ops.models():
            if model[0] == name and model[1].openai is not None:
                request[MODEL_KEY] = name  # only a model that serves the API: a client's names make no labels
                return web.Response(body=dumps(self._object(*model)), content_type=JSON)
        raise NotFound(f"The model `{name}` does not exist or does not serve OpenAI's API")
