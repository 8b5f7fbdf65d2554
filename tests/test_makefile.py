"""The Makefile's choice of Python and of system package manager, run by the real `make`.

A fresh Mac's `python3` is Apple's 3.9, which pip refuses for this project, and a Mac has Homebrew, not
apt-get. Neither exists here, so each test runs `make` on a copy of the Makefile with a PATH holding only
stand-ins: pythons that answer the Makefile's version probe (`-c`) with their version and record `-m venv`
and `-m pip` instead of doing them, `uname`, `id` and an `apt-get` that records being called.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAKE = shutil.which("make")
pytestmark = pytest.mark.skipif(MAKE is None, reason="no make on PATH")

# Host tools the recipes and the stand-ins use, linked into the stand-ins' folder (PATH holds nothing else).
HOST_TOOLS = ("rm", "mkdir", "touch", "cp", "cat")

FAKE_PYTHON = """#!/bin/sh
echo "${{0##*/}}@{version} $*" >> "$FAKE_LOG"
case "$1" in
  -c) echo {version}; exit {status} ;;
  -m) case "$2" in
        venv) mkdir -p "$3/bin" && cp "$0" "$3/bin/python"; exit $? ;;
        pip) exit {status} ;;
      esac ;;
esac
exit 2
"""

VERSIONS = {"python3.10": "3.10.16", "python3.11": "3.11.11", "python3.12": "3.12.8", "python3.13": "3.13.1"}

RECORDER = """#!/bin/sh
echo "${0##*/} $*" >> "$FAKE_LOG"
"""


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    log: list[str]


class Machine:
    """A copy of the Makefile and the files it depends on, and a PATH of stand-ins to run it with."""

    def __init__(self, root: Path) -> None:
        self.dir = root / "checkout"
        self.bin = root / "bin"
        self.log = root / "calls.log"
        self.dir.mkdir()
        self.bin.mkdir()
        for name in ("Makefile", "pyproject.toml", "constraints-cpu.txt"):
            shutil.copy(ROOT / name, self.dir / name)
        for tool in HOST_TOOLS:
            found = shutil.which(tool)
            assert found, tool
            (self.bin / tool).symlink_to(found)
        self.system("Linux", uid=1000)

    def script(self, name: str, text: str) -> Path:
        path = self.bin / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        return path

    def python(self, name: str, version: str) -> Path:
        too_old = tuple(int(part) for part in version.split(".")[:2]) < (3, 10)
        return self.script(name, FAKE_PYTHON.format(version=version, status=int(too_old)))

    def system(self, uname: str, uid: int) -> None:
        self.script("uname", f"#!/bin/sh\necho {uname}\n")
        self.script("id", f"#!/bin/sh\necho {uid}\n")
        self.script("apt-get", RECORDER)

    def make(self, *args: str, env: dict[str, str] | None = None) -> Run:
        self.log.write_text("")
        assert MAKE is not None
        done = subprocess.run(
            [MAKE, *args],
            cwd=self.dir,
            env={"PATH": str(self.bin), "FAKE_LOG": str(self.log), "HOME": str(self.dir), **(env or {})},
            capture_output=True,
            text=True,
            timeout=60,
        )
        return Run(done.returncode, done.stdout, done.stderr, self.log.read_text().splitlines())

    def venv_made_by(self, run: Run) -> list[str]:
        """Which interpreters made a venv in this run (`name@version`)."""
        return [line.split()[0] for line in run.log if " -m venv " in f"{line} "]


@pytest.fixture
def machine(tmp_path: Path) -> Machine:
    return Machine(tmp_path)


def apple_python3(machine: Machine) -> None:
    """What a Mac with only the Command Line Tools has: python3 (and python3.9) are Apple's 3.9.6."""
    machine.python("python3", "3.9.6")
    machine.python("python3.9", "3.9.6")


@pytest.mark.parametrize(
    ("present", "chosen"),
    [
        (("python3.10", "python3.11", "python3.12", "python3.13"), "python3.13@3.13.1"),
        (("python3.10", "python3.12"), "python3.12@3.12.8"),
        (("python3.10",), "python3.10@3.10.16"),
    ],
)
def test_the_newest_python_from_3_13_to_3_10_makes_the_venv_not_apples_python3(
    machine: Machine, present: tuple[str, ...], chosen: str
) -> None:
    apple_python3(machine)
    for name in present:
        machine.python(name, VERSIONS[name])
    run = machine.make("install")
    assert run.returncode == 0, run.stderr
    assert machine.venv_made_by(run) == [chosen]
    installs = [line for line in run.log if " -m pip install " in line]
    assert installs and all(line.startswith(f"python@{chosen.split('@')[1]} ") for line in installs)


def test_a_python_on_path_that_does_not_run_is_passed_over(machine: Machine) -> None:
    """pyenv puts a shim for every version it knows on PATH; the shim of one not selected fails."""
    apple_python3(machine)
    machine.script("python3.13", '#!/bin/sh\necho "pyenv: python3.13: command not found" >&2\nexit 127\n')
    machine.python("python3.11", "3.11.11")
    run = machine.make("install")
    assert run.returncode == 0, run.stderr
    assert machine.venv_made_by(run) == ["python3.11@3.11.11"]


def test_a_path_with_only_python_3_9_is_refused_with_a_one_line_hint_and_nothing_made(
    machine: Machine,
) -> None:
    apple_python3(machine)
    run = machine.make("run")
    assert run.returncode != 0
    hints = [line for line in run.stderr.splitlines() if "brew install python@3.12" in line]
    assert len(hints) == 1, run.stderr
    assert "3.9.6" in hints[0] and "make PY=" in hints[0]
    assert machine.venv_made_by(run) == []
    assert not (machine.dir / ".venv").exists() and not (machine.dir / ".stamps").exists()


def test_py_overrides_the_choice_and_is_checked_like_any_other(machine: Machine) -> None:
    apple_python3(machine)
    machine.python("python3.12", "3.12.8")
    eleven = machine.python("python3.11", "3.11.11")
    run = machine.make("install", f"PY={eleven}")
    assert run.returncode == 0, run.stderr
    assert machine.venv_made_by(run) == ["python3.11@3.11.11"]
    shutil.rmtree(machine.dir / ".venv")
    shutil.rmtree(machine.dir / ".stamps")

    run = machine.make("install", env={"PY": str(machine.bin / "python3.9")})
    assert run.returncode != 0
    assert "brew install python@3.12" in run.stderr
    assert machine.venv_made_by(run) == []
    assert not (machine.dir / ".venv").exists()


@pytest.mark.parametrize("stamped", [False, True], ids=["pip-refused-it", "stamp-present"])
def test_a_venv_of_python_3_9_is_made_again_with_the_chosen_python(machine: Machine, stamped: bool) -> None:
    """The first run on a Mac made .venv with 3.9 and pip refused to fill it; after `brew install
    python@3.12`, `make` replaces that venv instead of keeping it."""
    apple_python3(machine)
    (machine.dir / ".venv" / "bin").mkdir(parents=True)
    shutil.copy(machine.bin / "python3", machine.dir / ".venv" / "bin" / "python")
    if stamped:
        (machine.dir / ".stamps").mkdir()
        (machine.dir / ".stamps" / "venv").touch()
    machine.python("python3.12", "3.12.8")
    run = machine.make("install")
    assert run.returncode == 0, run.stderr
    assert machine.venv_made_by(run) == ["python3.12@3.12.8"]
    assert ".venv's Python is 3.9.6, not 3.10 or newer: making it again" in run.stdout
    assert not any(line.startswith("python@3.9.6 -m pip") for line in run.log)
    probe = subprocess.run(
        [str(machine.dir / ".venv" / "bin" / "python"), "-c", "probe"],
        env={"PATH": str(machine.bin), "FAKE_LOG": os.devnull},
        capture_output=True,
        text=True,
        check=True,
    )
    assert probe.stdout.strip() == "3.12.8"


def test_on_macos_homebrew_is_named_and_apt_get_never_called(machine: Machine) -> None:
    machine.python("python3", "3.13.1")  # Homebrew's python
    machine.python("python3.13", "3.13.1")
    machine.system("Linux", uid=0)
    linux = machine.make("system-tools")
    assert any(line.startswith("apt-get install") for line in linux.log), "the apt-get stand-in is reached"

    machine.system("Darwin", uid=0)
    run = machine.make("install")
    assert run.returncode == 0, run.stderr
    assert not any(line.startswith("apt-get") for line in run.log)
    assert "brew install libplist nghttp2 haproxy" in run.stdout
    assert "brew install --cask chromium chromedriver" in run.stdout
