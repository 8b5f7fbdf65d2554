"""structlog set-up: JSON lines when stderr is not a terminal (service log files), readable otherwise.

Every event reaches the daemon's event bus (`mpsd logs` chooses its own level), and only then is the
output level applied, so the level can change at runtime (LogSettings, SIGHUP) without reconfiguring.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Mapping
from typing import Any

import structlog

from mpsd.errors import InvalidArgument
from mpsd.logs.events import publish_processor
from mpsd.logs.levels import SEVERITIES, THRESHOLDS

LEVELS = THRESHOLDS  # what the output threshold may be set to (the front process imports this name)


class _Output:
    """What reaches stderr: the level threshold and the format chosen at start."""

    level = logging.INFO
    format = "console"


def _drop_below_level(logger: object, method_name: str, event_dict: Any) -> Any:
    if SEVERITIES.get(event_dict.get("level", method_name), logging.INFO) < _Output.level:
        raise structlog.DropEvent
    return event_dict


def configure(level: str = "info", fmt: str = "auto") -> None:
    json_lines = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if json_lines else structlog.dev.ConsoleRenderer(colors=False)
    )
    _Output.level = LEVELS[level]
    _Output.format = "json" if json_lines else "console"
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            publish_processor,
            _drop_below_level,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


_level_listeners: list[Callable[[str], None]] = []


def set_level(level: str) -> None:
    """Change the level at runtime (LogSettings, SIGHUP), and tell whoever listens (front processes,
    which filter their own events before the daemon sees them)."""
    _Output.level = LEVELS[level]
    for listener in list(_level_listeners):
        listener(level)


def level_name() -> str:
    return next(name for name, value in LEVELS.items() if value == _Output.level)


def on_level_change(listener: Callable[[str], None]) -> Callable[[], None]:
    """Call `listener(level)` after each `set_level`; returns what stops it."""
    _level_listeners.append(listener)
    return lambda: _level_listeners.remove(listener) if listener in _level_listeners else None


# ---- Triton's LogSettings ------------------------------------------------------------------------

_SETTING_TYPES: dict[str, type] = {
    "log_info": bool,
    "log_warning": bool,
    "log_error": bool,
    "log_verbose_level": int,
    "log_format": str,
    "log_file": str,
}
Setting = bool | int | str


def log_settings() -> dict[str, Setting]:
    """The output settings in Triton's terms (one threshold seen as per-severity switches)."""
    level = _Output.level
    return {
        "log_info": level <= logging.INFO,
        "log_warning": level <= logging.WARNING,
        "log_error": level <= logging.ERROR,
        "log_verbose_level": 1 if level <= logging.DEBUG else 0,
        "log_format": _Output.format,
        "log_file": "",
    }


def apply_log_settings(updates: Mapping[str, Setting]) -> dict[str, Setting]:
    """Apply Triton-style settings all-or-nothing; the lowest enabled severity becomes the threshold.

    Raises InvalidArgument for unknown keys, wrong types and what mpsd cannot do at runtime (a log file,
    another format), so a client never believes a setting took effect when it did not.
    """
    wanted = log_settings()
    for key, value in updates.items():
        expected = _SETTING_TYPES.get(key)
        if expected is None:
            raise InvalidArgument(f"unknown log setting '{key}' (known: {', '.join(_SETTING_TYPES)})")
        if type(value) is not expected:
            raise InvalidArgument(f"log setting '{key}' must be a {expected.__name__}")
        if key == "log_file" and value != "":
            raise InvalidArgument(
                "log_file is not supported: mpsd logs to stderr, which the service manager keeps "
                "(see `mpsd service logs`); use `mpsd logs` to follow the events"
            )
        if key == "log_format" and value != wanted["log_format"]:
            raise InvalidArgument(
                f"log_format cannot change at runtime (it is '{wanted['log_format']}'); "
                "set log_format in the daemon config"
            )
        wanted[key] = value
    set_level(_threshold(wanted))
    return log_settings()


def _threshold(settings: Mapping[str, Setting]) -> str:
    if int(settings["log_verbose_level"]) > 0:
        return "debug"
    for key, level in (("log_info", "info"), ("log_warning", "warning"), ("log_error", "error")):
        if settings[key]:
            return level
    return "off"
