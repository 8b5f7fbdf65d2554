"""The curl examples in the docs run as written against a real daemon serving the example repository:
every `curl` line of the `sh` blocks of docs/api.md and docs/observability.md, pointed at this daemon."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ROOT, RunningDaemon, free_port, serving

DOCS = ROOT / "docs"
HTTP, METRICS = "127.0.0.1:8000", "127.0.0.1:8002"  # the addresses the examples name

pytestmark = pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")


def curl_lines(page: Path) -> list[str]:
    text = page.read_text()
    blocks = re.findall(r"^```sh\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    return [
        line.strip() for block in blocks for line in block.splitlines() if line.strip().startswith("curl ")
    ]


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningDaemon, str]]:
    repo = tmp_path_factory.mktemp("examples") / "models"
    shutil.copytree(ROOT / "config" / "models", repo, ignore=shutil.ignore_patterns("*.pt", "*.pt2"))
    subprocess.run([sys.executable, "-m", "mpsd.examples", str(repo)], check=True, capture_output=True)
    metrics = f"127.0.0.1:{free_port()}"
    log = tmp_path_factory.mktemp("log") / "daemon.log"
    with serving(repo, log, extra_args=["--metrics-address", metrics]) as daemon:
        yield daemon, metrics


def test_the_docs_have_curl_examples() -> None:
    assert len(curl_lines(DOCS / "api.md")) >= 4
    assert len(curl_lines(DOCS / "observability.md")) >= 4


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
