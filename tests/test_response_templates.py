"""ModelInfer responses built from a template per model version and output signature
(`mpsd.daemon.api.respond.ResponseTemplates`) parse exactly as the message protobuf builds, whatever the
id, and a template stands only for the outputs it was built from. Each scenario runs in a fresh
interpreter: see tests/response_templates_scenarios.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("scenario", ["parses", "keys", "shm", "bounded"])
def test_response_templates(scenario: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tests.response_templates_scenarios", scenario],
        cwd=ROOT,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr
