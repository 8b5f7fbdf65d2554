"""One error taxonomy for the whole server.

Every failure a client can see is an `MpsdError` carrying an `ErrorCode`; the daemon maps codes to gRPC
status codes in exactly one place (`mpsd.daemon.status`). Workers send the code's name over IPC, so the
taxonomy must not depend on grpc.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.Enum):
    """What kind of failure happened, independent of the transport."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    UNAVAILABLE = "UNAVAILABLE"
    INTERNAL = "INTERNAL"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNIMPLEMENTED = "UNIMPLEMENTED"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    CANCELLED = "CANCELLED"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    UNAUTHENTICATED = "UNAUTHENTICATED"


class MpsdError(Exception):
    """Base error: a code plus a message meant for the client."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class InvalidArgument(MpsdError):
    code = ErrorCode.INVALID_ARGUMENT


class NotFound(MpsdError):
    code = ErrorCode.NOT_FOUND


class Unavailable(MpsdError):
    code = ErrorCode.UNAVAILABLE


class Internal(MpsdError):
    code = ErrorCode.INTERNAL


class ResourceExhausted(MpsdError):
    code = ErrorCode.RESOURCE_EXHAUSTED


class Unimplemented(MpsdError):
    code = ErrorCode.UNIMPLEMENTED


class FailedPrecondition(MpsdError):
    code = ErrorCode.FAILED_PRECONDITION


class DeadlineExceeded(MpsdError):
    code = ErrorCode.DEADLINE_EXCEEDED


class ConfigError(MpsdError):
    """A repository or daemon configuration problem; the message names the file, the field and the problem."""

    code = ErrorCode.INVALID_ARGUMENT


def error_from_code(code: str, message: str) -> MpsdError:
    """Rebuild an error that crossed the IPC boundary as (code name, message)."""
    try:
        parsed = ErrorCode(code)
    except ValueError:
        parsed = ErrorCode.INTERNAL
    return MpsdError(message, parsed)
