"""The log levels, in one table: how severe an event is, and which of them an operator may choose.

The daemon, its fronts, the event stream, the config schema and the command line all read it from here, so
that a level accepted in one place is never refused (or silently mapped to another) in the next.
"""

from __future__ import annotations

import logging
from typing import Literal, get_args

# An event's severity (structlog's method names), lowest first.
SEVERITIES: dict[str, int] = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}

# What an operator chooses: the daemon config's log_level, `mpsd serve --log-level`, `mpsd logs --level`.
LogLevel = Literal["debug", "info", "warning", "error"]
CHOICES: tuple[str, ...] = get_args(LogLevel)

# The output threshold: a chosen level, or "off" (Triton's LogSettings can switch every severity off).
THRESHOLDS: dict[str, int] = {**{name: SEVERITIES[name] for name in CHOICES}, "off": logging.CRITICAL + 10}
