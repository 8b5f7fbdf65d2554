"""One error taxonomy for the whole server.

Every failure a client can see is an `MpsdError` carrying an `ErrorCode`; the daemon maps codes to gRPC
status codes and HTTP statuses in exactly one place (`mpsd.net.status`). Workers send the code's name
over IPC, so the taxonomy must not depend on grpc.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass


class ErrorCode(enum.Enum):
    """What kind of failure happened, independent of the transport."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    UNAVAILABLE = "UNAVAILABLE"
    INTERNAL = "INTERNAL"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNIMPLEMENTED = "UNIMPLEMENTED"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    CANCELLED = "CANCELLED"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    UNAUTHENTICATED = "UNAUTHENTICATED"


# Messages often echo what the client sent (names, versions); they travel in a gRPC trailer, which a
# client refuses beyond a few KiB, so an echo of a huge name must not turn a clean error into a broken call.
MAX_MESSAGE_BYTES = 2000


def bounded(message: str, limit: int = MAX_MESSAGE_BYTES) -> str:
    """The message cut to `limit` UTF-8 bytes, saying how much was cut."""
    data = message.encode("utf-8", "backslashreplace")
    if len(data) <= limit:
        return message
    head = data[:limit].decode("utf-8", "ignore")
    return f"{head}... ({len(data) - limit} more bytes cut)"


class MpsdError(Exception):
    """Base error: a code plus a message meant for the client."""

    code: ErrorCode = ErrorCode.INTERNAL
    max_message_bytes: int | None = MAX_MESSAGE_BYTES

    def __init__(self, message: str, code: ErrorCode | None = None) -> None:
        if self.max_message_bytes is not None:
            message = bounded(message, self.max_message_bytes)
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class InvalidArgument(MpsdError):
    code = ErrorCode.INVALID_ARGUMENT


class InvalidField(InvalidArgument):
    """A field of a request that cannot be used, named in `param` for protocols whose errors name it
    (OpenAI's)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class NotFound(MpsdError):
    code = ErrorCode.NOT_FOUND


class AlreadyExists(MpsdError):
    code = ErrorCode.ALREADY_EXISTS


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


class Cancelled(MpsdError):
    """Nobody waits for the answer any more (the request that needed it went away)."""

    code = ErrorCode.CANCELLED


class PermissionDenied(MpsdError):
    """Authenticated, but the token's categories do not include the RPC's (or the RPC is switched off)."""

    code = ErrorCode.PERMISSION_DENIED


class Unauthenticated(MpsdError):
    """No valid credentials for a server that requires them."""

    code = ErrorCode.UNAUTHENTICATED


@dataclass(frozen=True)
class Issue:
    """One configuration problem as data, for tools that show each on its own (`mpsd validate`): the file
    ("" where the raiser does not know it), the field's path in it (`("input", 0, "dims")`; () for the file
    as a whole) and what is wrong."""

    file: str
    loc: tuple[str | int, ...]
    problem: str

    def __str__(self) -> str:
        """`file: field 'input.0.dims': problem`, the way the daemon's reasons name a field."""
        where = f"field '{'.'.join(str(p) for p in self.loc)}': " if self.loc else ""
        return f"{self.file}: {where}{self.problem}" if self.file else f"{where}{self.problem}"


class ConfigError(MpsdError):
    """A repository or daemon configuration problem; the message names the file, the field and the problem,
    and `issues`, where the raiser fills them in, hold the same as data (one per problem)."""

    code = ErrorCode.INVALID_ARGUMENT
    max_message_bytes = None  # written by the operator, read by the operator: keep every problem

    def __init__(self, message: str, code: ErrorCode | None = None, *, issues: Iterable[Issue] = ()) -> None:
        super().__init__(message, code)
        self.issues = tuple(issues)


class ModelConfigError(ConfigError, ValueError):
    """A model's config that cannot be used. Also a ValueError, which the config readers have always raised
    and their callers catch."""


# ---- Triton's own words -------------------------------------------------------------------------------
# Where Triton's clients, its client examples and its test suite match an answer's text
# (`"Request for unknown model" in message`, `"failed to load" in message`), the text is Triton's, to the
# letter: core's model_lifecycle.cc and model_repository_manager.cc, server's common.cc.


class UnknownModel(NotFound):
    """A model, or a version of one, that is not served; `unloaded`: a model unloaded on request, which
    Triton still knows, but without a version."""

    def __init__(self, name: str, version: int | None = None, unloaded: bool = False) -> None:
        if version is None and unloaded:
            super().__init__(f"Request for unknown model: '{name}' has no available versions")
            return
        which = f"'{name}'" if version is None else f"'{name}' version {version}"
        super().__init__(f"Request for unknown model: {which} is not found")


class BadVersion(InvalidArgument):
    """A version string that is no integer > 0, refused before the model is looked up."""

    def __init__(self, text: str, negative: bool = False) -> None:
        if negative:
            super().__init__(
                f"invalid model version specified '{text}' , version should be an integral value > 0"
            )
        else:  # `stol` is what Triton's message carries as the details of its std::stol failing
            super().__init__(
                f"failed to get model version from specified version string '{text}' (details: stol), "
                "version should be an integral value > 0"
            )


class LoadRefused(Internal):
    """RepositoryModelLoad that found nothing it could load: Triton's answer when the repository gives no
    model of that name, or when the load's parameters cannot be used; `reason` says which, where more
    than the model's absence."""

    def __init__(self, name: str, reason: str = "") -> None:
        why = f": {reason}" if reason else ""
        super().__init__(f"failed to load '{name}', failed to poll from model repository{why}")


class WorkerDied(Unavailable):
    """The worker process ended while a request was in flight (or before it could be sent)."""


class LoadError(MpsdError):
    """A model (version, instance) could not be loaded or warmed up; the message is the reason shown to
    operators (logs, the repository index) and, wrapped, to the client that asked for the load."""

    code = ErrorCode.INTERNAL
    max_message_bytes = None  # the worker's own reason (a traceback's last line, a path): kept whole


def error_from_code(code: str, message: str) -> MpsdError:
    """Rebuild an error that crossed the IPC boundary as (code name, message)."""
    try:
        parsed = ErrorCode(code)
    except ValueError:
        parsed = ErrorCode.INTERNAL
    return MpsdError(message, parsed)
