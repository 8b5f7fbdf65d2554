"""A ModelInfer header that passed its checks stands for the next requests with the same bytes: they skip
protobuf parsing and the checks, and still get their own tensor bytes, their own answers, and every error
the full path would give (`mpsd.daemon.api.known_headers`).

The servicer and the operations are the daemon's own; the registry and the model version under them are
stand-ins that answer at once (the whole path through a running daemon is in every other inference test).
Each scenario runs in a fresh interpreter: see tests/known_headers_scenarios.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("scenario", ["skips", "full-path", "sizes"])
def test_known_headers(scenario: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tests.known_headers_scenarios", scenario],
        cwd=ROOT,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr
