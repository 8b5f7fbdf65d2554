"""One line per check: what was found, whether it is fine, and what to do when it is not."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from mpsd.config.daemon_config import DaemonConfig

PASS, FAIL = "✅", "❌"


@dataclass(frozen=True)
class Check:
    """The outcome of one check; `fix` says what to do when it failed (None when it passed)."""

    check: str
    ok: bool
    detail: str
    fix: str | None = None


@dataclass(frozen=True)
class Setup:
    """The daemon config the checks read: the file (None: the built-in defaults) and its settings, or why
    it could not be read."""

    path: Path | None
    config: DaemonConfig | None
    error: str | None = None


def passed(name: str, detail: str) -> Check:
    return Check(name, True, detail)


def failed(name: str, detail: str, fix: str) -> Check:
    return Check(name, False, detail, fix)


def guarded(name: str, run: Callable[[], Check], debug: bool = False) -> Check:
    """A check that raised is a failed check, named, rather than the end of the report."""
    try:
        return run()
    except Exception as exc:
        if debug:
            raise
        return failed(name, f"the check itself failed: {type(exc).__name__}: {exc}", "run with --debug")


def line(check: Check) -> str:
    text = f"{PASS if check.ok else FAIL} {check.check}: {check.detail}"
    return text if check.fix is None else f"{text}\n   fix: {check.fix}"


def as_json(checks: Sequence[Check]) -> str:
    return json.dumps([asdict(c) for c in checks], indent=2, ensure_ascii=False)
