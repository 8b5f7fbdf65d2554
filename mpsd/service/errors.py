"""The one error type the service commands raise, so the CLI can print it without a traceback."""

from __future__ import annotations


class ServiceError(Exception):
    """A failure the user can act on: a one-line message and, where we know one, a hint."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
