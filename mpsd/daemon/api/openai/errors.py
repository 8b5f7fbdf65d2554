"""OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`, with the HTTP status of the one
table (`net.status`), so a client of OpenAI's (its Python library raises BadRequestError, NotFoundError,
AuthenticationError, RateLimitError, ... by status) sees what it would from OpenAI.

The `type` and `code` follow OpenAI's: `invalid_request_error` for what the client must change, with `code`
`model_not_found` (404) and `invalid_api_key` (401); `rate_limit_error` for a full queue or a model that does
not fit the memory budget now (429, which OpenAI's clients retry after a pause); `server_error` for the
rest of 5xx.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from mpsd.errors import ErrorCode, InvalidField, MpsdError

JSON = "application/json"
_CODES: dict[ErrorCode, str] = {
    ErrorCode.NOT_FOUND: "model_not_found",
    ErrorCode.UNAUTHENTICATED: "invalid_api_key",
    ErrorCode.PERMISSION_DENIED: "permission_denied",
    ErrorCode.RESOURCE_EXHAUSTED: "rate_limit_exceeded",
    ErrorCode.UNAVAILABLE: "service_unavailable",
    ErrorCode.DEADLINE_EXCEEDED: "timeout",
    ErrorCode.UNIMPLEMENTED: "unsupported",
}


def error_type(status: int) -> str:
    if status == 429:
        return "rate_limit_error"
    return "server_error" if status >= 500 else "invalid_request_error"


def error_dict(status: int, message: str, error: MpsdError | None) -> dict[str, Any]:
    """The `error` object: what failed, for a status and (where it is one) the error of the taxonomy."""
    code = _CODES.get(error.code) if error is not None else None
    if status == 404 and error is None:
        code = "unknown_url"  # a path that is not one of the API's
    param = error.param if isinstance(error, InvalidField) else None
    if code == "model_not_found":
        param = "model"
    return {"message": message, "type": error_type(status), "param": param, "code": code}


def openai_error(
    status: int, message: str, error: MpsdError | None, headers: Mapping[str, str] | None
) -> web.Response:
    """The response to an error (the `api.web.ErrorWriter` of this adapter)."""
    body = json.dumps({"error": error_dict(status, message, error)}).encode()
    return web.Response(body=body, status=status, content_type=JSON, headers=headers)
