"""What the tools share: the error they raise for operators, how they find the model repository, and
how they print tables."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

DEFAULT_CONFIG = Path("config/mpsd.yaml")
EX_UNAVAILABLE = 69  # sysexits.h: the daemon cannot be reached


class ToolError(Exception):
    """An expected failure: printed as one line plus a hint, never as a traceback (unless --debug)."""

    def __init__(self, message: str, hint: str = "", status: int = 1) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.status = status


def default_repository(config: Path | None) -> tuple[Path, bool, tuple[Path, ...]]:
    """The repository a daemon started with `config` (default config/mpsd.yaml) would serve, whether that
    daemon follows symlinks out of it, and the directories outside the models it loads op libraries from."""
    from mpsd.config.daemon_config import load_daemon_config
    from mpsd.errors import ConfigError

    path = config if config is not None else DEFAULT_CONFIG
    if not path.is_file():
        raise ToolError(
            f"no repository given and {path} does not exist",
            "pass the repository directory, e.g. `mpsd validate config/models`, or --config FILE",
        )
    try:
        settings = load_daemon_config(path)
    except ConfigError as exc:
        raise ToolError(exc.message, "fix the daemon config file, or pass the repository directory") from None
    return settings.model_repository, settings.allow_symlinks, tuple(settings.op_library_dirs)


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns two spaces apart, as `mpsd status`, `models` and `infer` print them."""
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows, strict=True)]
    lines = [
        "  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in [headers, *rows]
    ]
    return "\n".join(lines)
