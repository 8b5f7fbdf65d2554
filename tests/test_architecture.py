"""The architecture the tree shows is the one the code has: layers import only downward (the contracts
in pyproject.toml, checked by import-linter), no module takes part in an import cycle, and the daemon's
modules stay small enough to have one job."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parent.parent
MAX_DAEMON_MODULE_LINES = 400


def test_import_contracts_hold() -> None:
    linter = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run(
        [str(linter), "--config", str(ROOT / "pyproject.toml")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def import_cycles(graph: grimp.ImportGraph, modules: set[str]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan), imports under TYPE_CHECKING included:
    a type-only import back up is still a dependency back up."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in sorted(graph.find_modules_directly_imported_by(module)):
            if other not in modules:
                continue
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            group = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                group.append(top)
                if top == module:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for module in sorted(modules):
        if module not in index:
            visit(module)
    return cycles


def test_no_import_cycles() -> None:
    graph = grimp.build_graph("mpsd")
    modules = {m for m in graph.modules if not m.startswith("mpsd.proto")}
    assert import_cycles(graph, modules) == []


def test_import_cycles_are_found() -> None:
    """The check itself: a cycle of two modules is reported."""
    graph = grimp.ImportGraph()
    for name in ("pkg", "pkg.a", "pkg.b", "pkg.c"):
        graph.add_module(name)
    graph.add_import(importer="pkg.a", imported="pkg.b")
    graph.add_import(importer="pkg.b", imported="pkg.a")
    graph.add_import(importer="pkg.c", imported="pkg.a")
    assert import_cycles(graph, {"pkg.a", "pkg.b", "pkg.c"}) == [["pkg.a", "pkg.b"]]


def test_daemon_modules_are_small() -> None:
    sizes = {
        str(path.relative_to(ROOT)): len(path.read_text().splitlines())
        for path in (ROOT / "mpsd" / "daemon").rglob("*.py")
    }
    assert {name: n for name, n in sizes.items() if n > MAX_DAEMON_MODULE_LINES} == {}


def test_the_architecture_page_names_files_that_exist() -> None:
    """docs/architecture.md's map of the request path names real files: a move that forgets the page fails."""
    import re

    text = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`((?:mpsd/)?[\w/]+\.py)`", text))
    assert len(named) >= 12, named
    missing = []
    for name in sorted(named):
        candidates = [ROOT / name, ROOT / "mpsd" / name, ROOT / "mpsd" / "daemon" / name]
        if not any(path.is_file() for path in candidates):
            missing.append(name)
    assert missing == []
