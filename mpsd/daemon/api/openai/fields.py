"""Reading an OpenAI request body: a JSON object within the size limit, its fields checked by type, each
error naming the field (`InvalidField`, OpenAI's `param`).

Fields the daemon does not use itself reach the model as request parameters (`infer(inputs, parameters)`),
where its section says `parameters: true`; a model without refuses them by name, so that a setting is never
silently ignored.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Mapping
from typing import Any

from aiohttp import web

from mpsd.config.model_config import ModelConfig, OpenAIConfig
from mpsd.daemon.api.call import Param
from mpsd.daemon.api.operations import Operations
from mpsd.daemon.api.parse import check_name
from mpsd.daemon.api.web import read_body
from mpsd.errors import InvalidArgument, InvalidField, NotFound, Unavailable

ENDPOINTS = {
    "embeddings": "/v1/embeddings",
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "transcription": "/v1/audio/transcriptions",
}
# Fields OpenAI's API defines that every endpoint accepts and no model needs: `user` identifies the
# application's end user to OpenAI's abuse monitoring, of which the daemon has none.
IGNORED = frozenset({"user"})


async def json_body(request: web.Request, limit: int) -> dict[str, Any]:
    data = await read_body(request, limit)
    try:
        value = json.loads(bytes(data))
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidArgument(f"the request body is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidArgument("the request body must be a JSON object")
    return value


def string(body: Mapping[str, Any], key: str, default: str | None = None) -> str:
    value = body.get(key, default)
    if value is None:
        raise InvalidField(key, f"'{key}' is required")
    if not isinstance(value, str):
        raise InvalidField(key, f"'{key}' must be a string")
    return value


def integer(body: Mapping[str, Any], key: str, low: int, high: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidField(key, f"'{key}' must be an integer")
    if value < low or (high is not None and value > high):
        bound = f"at least {low}" if high is None else f"from {low} to {high}"
        raise InvalidField(key, f"'{key}' must be {bound}, not {value}")
    return value


def boolean(body: Mapping[str, Any], key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidField(key, f"'{key}' must be a boolean")
    return value


def finite(value: Any) -> bool:
    """A JSON number that is not NaN or infinite (Python's json reads those tokens)."""
    return not isinstance(value, float) or math.isfinite(value)


def _config(ops: Operations, name: str) -> ModelConfig:
    """The config the model answers with: its running version's, found as a request's version is; for one
    not running (it loads on demand), its repository's, as ModelMetadata reads it."""
    try:
        return ops.registry.route(name, "").config
    except Unavailable:
        config, _ = ops.metadata(name, "")
        return config


def target(ops: Operations, body: Mapping[str, Any], task: str) -> tuple[str, ModelConfig, OpenAIConfig]:
    """The model a request names, its config, and its `openai` section, which must serve `task`: an unknown
    model or one that does not serve OpenAI's API is 404 `model_not_found`, one of another task 400."""
    name = string(body, "model")
    try:
        check_name("model", name)
    except InvalidArgument as exc:
        raise InvalidField("model", exc.message) from None
    try:
        config = _config(ops, name)
    except NotFound:
        raise NotFound(f"The model `{name}` does not exist") from None
    section = config.openai
    if section is None:
        raise NotFound(f"The model `{name}` does not serve OpenAI's API: its config has no `openai` section")
    if section.task != task:
        raise InvalidField(
            "model",
            f"The model `{name}` serves {section.task} ({ENDPOINTS[section.task]}), not {task}",
        )
    return name, config, section


def passed_on(
    body: Mapping[str, Any], used: Collection[str], section: OpenAIConfig, name: str, **own: Any
) -> dict[str, Param]:
    """The fields the daemon does not use itself, and the adapter's `own`, as the model's request
    parameters; for a model that takes none (`openai.parameters` false), any such field is refused by name."""
    rest = {k: v for k, v in body.items() if k not in used and k not in IGNORED and v is not None}
    if not section.parameters:
        if rest:
            raise InvalidField(
                sorted(rest)[0],
                f"the model `{name}` takes no parameters (its config's openai.parameters is not set): "
                f"{', '.join(sorted(rest))}",
            )
        return {}
    return {key: parameter(value) for key, value in {**own, **rest}.items()}


def parameter(value: Any) -> Param:
    """A JSON value as a request parameter: a scalar as its kind, an array or object as its JSON text."""
    if isinstance(value, bool):
        return Param("bool", value)
    if isinstance(value, int):
        return Param("int64" if value < 2**63 else "uint64", value)
    if isinstance(value, float):
        return Param("double", value)
    if isinstance(value, str):
        return Param("string", value)
    return Param("string", dumps(value).decode())


def dumps(value: Any) -> bytes:
    """Compact JSON, as every answer of this adapter is written."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()
