"""Test scenarios that run in a fresh interpreter (`python -m tests.<module> NAME`): the daemon's gRPC
messages and tritonclient's share protobuf package names, so they cannot be loaded in one process, and the
test process has tritonclient's."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_scenario(module: str, scenario: str) -> None:
    """Run `scenario` of tests.`module` in a fresh interpreter; it must print "ok" and exit 0."""
    done = subprocess.run(
        [sys.executable, "-m", f"tests.{module}", scenario],
        cwd=ROOT,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr


def main(scenarios: Mapping[str, Callable[[], None]]) -> None:
    """A scenario module's entry point: run the scenario named on the command line."""
    scenarios[sys.argv[1]]()
    print("ok")
