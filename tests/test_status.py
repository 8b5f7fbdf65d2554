"""The one status table: every error code has its gRPC code and its HTTP status, the gRPC side as it always
was (each code to the gRPC code of its name), the HTTP side as Triton's HTTP server answers."""

from __future__ import annotations

from http import HTTPStatus

import grpc
import pytest

from mpsd.errors import ErrorCode, MpsdError
from mpsd.net.status import GRPC_STATUS, HTTP_STATUS, STATUS, grpc_status, http_status

# Triton's HttpCodeFromError (src/http_server.cc) for the codes both taxonomies have.
TRITON_HTTP = {
    ErrorCode.INVALID_ARGUMENT: 400,
    ErrorCode.ALREADY_EXISTS: 400,
    ErrorCode.CANCELLED: 400,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.UNIMPLEMENTED: 501,
    ErrorCode.INTERNAL: 500,
}


def test_every_code_has_both_statuses() -> None:
    assert set(STATUS) == set(ErrorCode)
    assert set(GRPC_STATUS) == set(HTTP_STATUS) == set(ErrorCode)


@pytest.mark.parametrize("code", list(ErrorCode))
def test_grpc_codes_keep_their_names(code: ErrorCode) -> None:
    assert grpc_status(MpsdError("x", code)) is getattr(grpc.StatusCode, code.value)


def test_http_statuses_follow_triton_and_are_errors() -> None:
    for code, status in TRITON_HTTP.items():
        assert http_status(MpsdError("x", code)) == status, code
    assert http_status(MpsdError("x", ErrorCode.UNAUTHENTICATED)) == HTTPStatus.UNAUTHORIZED
    assert http_status(MpsdError("x", ErrorCode.PERMISSION_DENIED)) == HTTPStatus.FORBIDDEN
    assert http_status(MpsdError("x", ErrorCode.RESOURCE_EXHAUSTED)) == HTTPStatus.TOO_MANY_REQUESTS
    assert all(400 <= status < 600 for status in HTTP_STATUS.values())
