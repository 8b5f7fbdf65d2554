"""The architecture the tree shows is the one the code has: layers import only downward (the contracts
in pyproject.toml, checked by import-linter), no module takes part in an import cycle, the daemon's, the
worker's and the config's modules stay small enough to have one job, no function in mpsd/ is longer
than a screen (cyclomatic complexity is ruff's C901, in pyproject.toml), and the daemon builds its requests
in one module."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parent.parent
MAX_MODULE_LINES = 400
CAPPED_PACKAGES = ("daemon", "worker", "config")  # under mpsd/
MAX_FUNCTION_LINES = 60


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


def test_daemon_worker_and_config_modules_are_small() -> None:
    sizes = {
        str(path.relative_to(ROOT)): len(path.read_text().splitlines())
        for package in CAPPED_PACKAGES
        for path in (ROOT / "mpsd" / package).rglob("*.py")
    }
    assert len(sizes) > 100, sorted(sizes)
    assert {name: n for name, n in sizes.items() if n > MAX_MODULE_LINES} == {}


def long_functions(path: Path, limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """`file:function` -> lines, for each function (methods and nested ones too) longer than `limit` lines,
    from its `def` to its last line."""
    tree = ast.parse(path.read_text(), filename=str(path))
    name = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name
    return {
        f"{name}:{node.name}": node.end_lineno - node.lineno + 1
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > limit
    }


def test_functions_are_short() -> None:
    found: dict[str, int] = {}
    for path in sorted((ROOT / "mpsd").rglob("*.py")):
        if "_pb2" not in path.name:
            found.update(long_functions(path))
    assert found == {}


def test_a_long_function_is_found(tmp_path: Path) -> None:
    """The check itself: a method one line over the limit is reported, a function at the limit is not."""
    lines = MAX_FUNCTION_LINES - 1
    short = "def short():\n" + "".join(f"    x = {i}\n" for i in range(lines))
    long = "class C:\n    async def long(self):\n" + "".join(f"        x = {i}\n" for i in range(lines + 1))
    source = tmp_path / "m.py"
    source.write_text(short + "\n\n" + long)
    assert long_functions(source) == {"m.py:long": MAX_FUNCTION_LINES + 1}


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


REQUEST_BUILDER = "mpsd/daemon/core/requests.py"


def request_builders(root: Path) -> set[str]:
    """The files under `root` that call `InferRequest(...)` (by that name or as an attribute)."""
    found = set()
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Call):
                called = node.func
                name = called.id if isinstance(called, ast.Name) else getattr(called, "attr", None)
                if name == "InferRequest":
                    found.add(str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name)
    return found


def test_the_daemon_builds_every_request_in_one_module(tmp_path: Path) -> None:
    """docs/architecture.md: every request the daemon serves is built in `core/requests.py`, one factory per
    source, so that priority, parameters, deadline and the cache follow one set of rules. A known header's
    request is that module's request with another id and other bytes (`known_headers._rebound`), not a
    new one. The check itself finds a call made another way too."""
    assert request_builders(ROOT / "mpsd" / "daemon") == {REQUEST_BUILDER}
    (tmp_path / "m.py").write_text("import r\nr.InferRequest('m', '1', '', (), ('y',))\n")
    assert request_builders(tmp_path) == {"m.py"}
