"""structlog set-up: JSON lines when stderr is not a terminal (service log files), readable otherwise."""

from __future__ import annotations

import logging
import sys

import structlog

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def configure(level: str = "info", fmt: str = "auto") -> None:
    json_lines = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if json_lines else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def set_level(level: str) -> None:
    """Change the level at runtime (LogSettings, SIGHUP)."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(LEVELS[level]))
