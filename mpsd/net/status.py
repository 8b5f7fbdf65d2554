"""The one place where mpsd's error taxonomy becomes protocol status codes: gRPC's and HTTP's.

HTTP statuses follow Triton's HTTP server where Triton has the code (INVALID_ARGUMENT, ALREADY_EXISTS and
CANCELLED are 400, NOT_FOUND 404, UNAVAILABLE 503, UNIMPLEMENTED 501, INTERNAL 500), and the usual
mapping of gRPC codes to HTTP for the codes Triton lacks.
"""

from __future__ import annotations

from dataclasses import dataclass
from http import HTTPStatus

import grpc

from mpsd.errors import ErrorCode, MpsdError


@dataclass(frozen=True)
class Status:
    """How one error code is answered on each protocol."""

    grpc: grpc.StatusCode
    http: HTTPStatus


STATUS: dict[ErrorCode, Status] = {
    ErrorCode.INVALID_ARGUMENT: Status(grpc.StatusCode.INVALID_ARGUMENT, HTTPStatus.BAD_REQUEST),
    ErrorCode.NOT_FOUND: Status(grpc.StatusCode.NOT_FOUND, HTTPStatus.NOT_FOUND),
    ErrorCode.ALREADY_EXISTS: Status(grpc.StatusCode.ALREADY_EXISTS, HTTPStatus.BAD_REQUEST),
    ErrorCode.UNAVAILABLE: Status(grpc.StatusCode.UNAVAILABLE, HTTPStatus.SERVICE_UNAVAILABLE),
    ErrorCode.INTERNAL: Status(grpc.StatusCode.INTERNAL, HTTPStatus.INTERNAL_SERVER_ERROR),
    ErrorCode.RESOURCE_EXHAUSTED: Status(grpc.StatusCode.RESOURCE_EXHAUSTED, HTTPStatus.TOO_MANY_REQUESTS),
    ErrorCode.UNIMPLEMENTED: Status(grpc.StatusCode.UNIMPLEMENTED, HTTPStatus.NOT_IMPLEMENTED),
    ErrorCode.FAILED_PRECONDITION: Status(grpc.StatusCode.FAILED_PRECONDITION, HTTPStatus.BAD_REQUEST),
    ErrorCode.DEADLINE_EXCEEDED: Status(grpc.StatusCode.DEADLINE_EXCEEDED, HTTPStatus.GATEWAY_TIMEOUT),
    ErrorCode.CANCELLED: Status(grpc.StatusCode.CANCELLED, HTTPStatus.BAD_REQUEST),
    ErrorCode.PERMISSION_DENIED: Status(grpc.StatusCode.PERMISSION_DENIED, HTTPStatus.FORBIDDEN),
    ErrorCode.UNAUTHENTICATED: Status(grpc.StatusCode.UNAUTHENTICATED, HTTPStatus.UNAUTHORIZED),
}
GRPC_STATUS: dict[ErrorCode, grpc.StatusCode] = {code: s.grpc for code, s in STATUS.items()}
HTTP_STATUS: dict[ErrorCode, HTTPStatus] = {code: s.http for code, s in STATUS.items()}


def grpc_status(error: MpsdError) -> grpc.StatusCode:
    return GRPC_STATUS[error.code]


def http_status(error: MpsdError) -> HTTPStatus:
    return HTTP_STATUS[error.code]
