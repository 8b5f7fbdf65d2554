"""The documentation stays true: every config field is documented with its real default, every link
resolves, and the README quickstart and the docs' curl examples run as written against a real daemon."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args

import pytest
from pydantic import BaseModel

from mpsd.config.daemon_config import DaemonConfig
from mpsd.config.model_config import ModelConfig
from tests.conftest import ROOT, RunningDaemon, free_port, serving

DOCS = ROOT / "docs"
README = ROOT / "README.md"
BIN = Path(sys.executable).parent
README_ADDRESS = "127.0.0.1:8001"
# mpsd commands that talk to a daemon: the test points them at its own daemon.
CLIENT_COMMANDS = ("infer", "models", "status", "health", "logs", "reload")


# ---- config reference ------------------------------------------------------------------------------------


def _models_in(annotation: Any) -> Iterator[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
    for arg in get_args(annotation):
        yield from _models_in(arg)


def config_models(root: type[BaseModel]) -> list[type[BaseModel]]:
    """`root` and every model nested in its fields (lists, optionals and dict values included)."""
    found: list[type[BaseModel]] = []
    pending = [root]
    while pending:
        model = pending.pop(0)
        if model in found:
            continue
        found.append(model)
        for info in model.model_fields.values():
            pending.extend(_models_in(info.annotation))
    return found


def sections(text: str) -> dict[str, str]:
    """Heading line -> the text up to the next heading of any level."""
    parts = re.split(r"^(#{1,6} .*)$", text, flags=re.MULTILINE)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def table_rows(body: str) -> dict[str, list[str]]:
    """Rows of the field tables in a section: field name -> cells (pipes inside cells are escaped)."""
    rows = {}
    for line in body.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if cells and (m := re.fullmatch(r"`([a-z0-9_]+)`", cells[0])):
            rows[m.group(1)] = cells
    return rows


def documented_default(value: object) -> str | None:
    """How a simple default is written in the docs' default column; None for defaults not checked."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (int, str, Path)):
        return str(value)
    return None


@pytest.mark.parametrize(
    ("root", "doc"), [(ModelConfig, "configuration.md"), (DaemonConfig, "daemon-config.md")]
)
def test_every_config_field_is_documented_with_its_default(root: type[BaseModel], doc: str) -> None:
    by_heading = sections((DOCS / doc).read_text())
    problems = []
    for model in config_models(root):
        name = model.__name__
        heading = next((h for h in by_heading if re.search(rf"\b{name}\b", h)), None)
        if heading is None:
            problems.append(f"no section for {name}")
            continue
        rows = table_rows(by_heading[heading])
        fields = set(model.model_fields)
        problems += [f"{name}.{f} is not documented" for f in sorted(fields - set(rows))]
        problems += [f"{name}.{f} is documented but does not exist" for f in sorted(set(rows) - fields)]
        for field, info in model.model_fields.items():
            expected = documented_default(info.default)
            if field in rows and expected is not None and f"`{expected}`" not in rows[field][2]:
                problems.append(f"{name}.{field}: default `{expected}` not in {rows[field][2]!r}")
    assert not problems, f"{doc}:\n" + "\n".join(problems)


def test_config_models_are_found_recursively() -> None:
    """The walk above must see nested models, or the check would pass vacuously."""
    names = {m.__name__ for m in config_models(ModelConfig)}
    assert {"InputConfig", "OutputConfig", "InstanceGroup", "LatestPolicy", "DynamicBatching"} <= names
    assert {"DaemonConfig", "TlsConfig", "TokenConfig"} <= {m.__name__ for m in config_models(DaemonConfig)}


# ---- links -----------------------------------------------------------------------------------------------


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = heading.lstrip("#").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def test_readme_and_docs_links_resolve() -> None:
    pages = [README, *sorted(DOCS.glob("*.md"))]
    linked = set()
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"^[a-z]+://", target):
                continue
            path_part, _, fragment = target.partition("#")
            path = (page.parent / path_part).resolve() if path_part else page
            linked.add(path)
            if not path.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif fragment and path.suffix == ".md":
                anchors = {anchor(h) for h in sections(path.read_text())}
                if fragment not in anchors:
                    broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
    unlinked = [p.name for p in DOCS.glob("*.md") if p.resolve() not in linked]
    assert not unlinked, f"docs not linked from anywhere: {unlinked}"


# ---- the README quickstart ---------------------------------------------------------------------------------


def quickstart_blocks() -> list[tuple[str, str]]:
    """The fenced code blocks of the README's Quickstart section, as (language, code)."""
    text = README.read_text()
    match = re.search(r"^## Quickstart\n(.*?)(?=^## )", text, re.MULTILINE | re.DOTALL)
    assert match is not None, "README.md has no '## Quickstart' section"
    fences = re.finditer(r"^```(\w+)\n(.*?)^```", match.group(1), re.MULTILINE | re.DOTALL)
    return [(m.group(1), m.group(2)) for m in fences]


def shell_line(line: str, address: str) -> str:
    """A documented command as this test runs it: this interpreter's scripts, the test daemon's address."""
    line = re.sub(r"(^|\s)\.venv/bin/", rf"\g<1>{BIN}/", line).replace(README_ADDRESS, address)
    words = line.split()
    client = len(words) > 1 and Path(words[0]).name == "mpsd" and words[1] in CLIENT_COMMANDS
    if client and "--address" not in words:
        line += f" --address {address}"
    return line


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningDaemon, str]]:
    """What `make run` serves: the example repository with its models built, here on free ports; the
    daemon and its metrics address."""
    repo = tmp_path_factory.mktemp("quickstart") / "models"
    shutil.copytree(ROOT / "config" / "models", repo, ignore=shutil.ignore_patterns("*.pt", "*.pt2"))
    subprocess.run([sys.executable, "-m", "mpsd.examples", str(repo)], check=True, capture_output=True)
    metrics = f"127.0.0.1:{free_port()}"
    log = tmp_path_factory.mktemp("log") / "daemon.log"
    with serving(repo, log, extra_args=["--metrics-address", metrics]) as daemon:
        yield daemon, metrics


@pytest.fixture
def example_daemon(example: tuple[RunningDaemon, str]) -> RunningDaemon:
    return example[0]


def test_readme_quickstart_runs(example_daemon: RunningDaemon, tmp_path: Path) -> None:
    blocks = quickstart_blocks()
    assert {lang for lang, _ in blocks} >= {"python", "sh"}, "the quickstart needs Python and shell examples"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    serve_steps = 0
    for lang, code in blocks:
        if lang == "python":
            assert README_ADDRESS in code, "the Python example should connect to the default address"
            result = subprocess.run(
                [sys.executable, "-c", code.replace(README_ADDRESS, example_daemon.address)],
                cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert result.returncode == 0, f"{code}\n{result.stderr}"
            assert "16.]]" in result.stdout, result.stdout  # the documented a + b
            continue
        assert lang == "sh", f"unexpected block language {lang!r} in the quickstart"
        for line in code.splitlines():
            command = line.split("#", 1)[0].strip()
            if not command:
                continue
            if command == "make run":  # the fixture serves the same repository
                serve_steps += 1
                continue
            result = subprocess.run(
                ["bash", "-c", shell_line(command, example_daemon.address)],
                cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
            )  # fmt: skip
            assert result.returncode == 0, f"{command}\n{result.stdout}\n{result.stderr}"
            assert result.stdout.strip(), f"{command} printed nothing"
    assert serve_steps == 1, "the quickstart should start the daemon with `make run` once"


# ---- the supported Python versions -------------------------------------------------------------------------


def python_floor() -> str:
    """The oldest Python the project supports, from requires-python (">=3.X")."""
    text = (ROOT / "pyproject.toml").read_text()
    match = re.search(r'^requires-python = ">=(3\.\d+)"$', text, re.MULTILINE)
    assert match is not None, "pyproject.toml: requires-python should read '>=3.X'"
    return match.group(1)


def test_the_oldest_python_supported_is_the_one_checked() -> None:
    """README.md's "Python 3.X or newer" is requires-python's floor, and the checkers hold the code to it:
    ruff's target-version (syntax and upgrades) and mypy's python_version (3.11-only names of the standard
    library, such as datetime.UTC or asyncio.timeout, are errors in `make lint`)."""
    floor = python_floor()
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(rf"^Python {re.escape(floor)} or newer", README.read_text(), re.MULTILINE), floor
    assert f'target-version = "py{floor.replace(".", "")}"' in pyproject
    assert re.search(rf'^python_version = "{re.escape(floor)}"', pyproject, re.MULTILINE)


def test_every_module_compiles_with_the_oldest_python_supported() -> None:
    """Syntax newer than the floor (`except*`, PEP 695 generics, ...) would break every import there."""
    floor = python_floor()
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    candidates = [*map(str, sorted(pyenv.glob(f"versions/{floor}.*/bin/python{floor}"))), f"python{floor}"]

    def runs(candidate: str) -> bool:  # a pyenv shim on PATH may name a version it will not run
        path = shutil.which(candidate)
        return path is not None and subprocess.run([path, "-c", ""], capture_output=True).returncode == 0

    interpreter = next((c for c in candidates if runs(c)), None)
    if interpreter is None:
        pytest.skip(f"no Python {floor} on this machine")
    script = (
        "import pathlib, sys\n"
        "for path in sorted(pathlib.Path('mpsd').rglob('*.py')):\n"
        "    try:\n"
        "        compile(path.read_text(), str(path), 'exec')\n"
        "    except SyntaxError as exc:\n"
        "        print(f'{path}:{exc.lineno}: {exc.msg}')\n"
        "print(sys.version_info[:2])\n"
    )
    done = subprocess.run([interpreter, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    *errors, version = done.stdout.splitlines()
    assert version == str(tuple(int(n) for n in floor.split("."))), version
    assert not errors, "\n".join(errors)


# ---- curl examples ---------------------------------------------------------------------------------------
# Every `curl` line of the `sh` blocks of docs/api.md and docs/observability.md runs as written against the
# example daemon, pointed at its addresses.

HTTP, METRICS = "127.0.0.1:8000", "127.0.0.1:8002"  # the addresses the examples name
needs_curl = pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")


def curl_lines(page: Path) -> list[str]:
    text = page.read_text()
    blocks = re.findall(r"^```sh\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    return [
        line.strip() for block in blocks for line in block.splitlines() if line.strip().startswith("curl ")
    ]


def test_the_docs_have_curl_examples() -> None:
    assert len(curl_lines(DOCS / "api.md")) >= 4
    assert len(curl_lines(DOCS / "observability.md")) >= 4


@needs_curl
@pytest.mark.parametrize("page", ["api.md", "observability.md"])
def test_curl_examples_run(example: tuple[RunningDaemon, str], page: str) -> None:
    daemon, metrics = example
    outputs = {}
    for line in curl_lines(DOCS / page):
        command = line.replace(HTTP, daemon.http_address).replace(METRICS, metrics)
        done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"{line}\n{done.stdout}\n{done.stderr}"
        assert done.stdout.strip(), f"{line} printed nothing"
        assert '"error"' not in done.stdout, f"{line}\n{done.stdout}"
        outputs[line] = done.stdout
    if page == "api.md":
        assert any('"data":[2.5,5.0,7.5]' in out for out in outputs.values()), outputs
    else:
        codes = [out.strip() for out in outputs.values() if out.strip().isdigit()]
        assert codes and set(codes) == {"200"}, outputs
