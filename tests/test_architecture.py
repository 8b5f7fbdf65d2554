"""The architecture the tree shows is the one the code has: layers import only downward (the contracts
in pyproject.toml, checked by import-linter), no module takes part in an import cycle, the daemon's, the
worker's and the config's modules stay small enough to have one job, and no function in mpsd/ is longer
than a screen (cyclomatic complexity is ruff's C901, in pyproject.toml)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

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


ROOMS = ("mpsd.daemon.api", "mpsd.daemon.dataplane", "mpsd.worker")
MAX_STOPS = 10


def walk(heading: str) -> list[str]:
    """The modules a walk in docs/architecture.md stops in, in its order (`N. \\`path\\`` items)."""
    import re

    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split(f"### {heading}", 1)[1].split("\n#", 1)[0]
    paths = re.findall(r"^\d+\. `([\w/]+)\.py`", section, re.MULTILINE)
    return ["mpsd." + path.replace("/", ".") for path in paths]


def room(module: str) -> int | None:
    return next((i for i, prefix in enumerate(ROOMS) if module.startswith(prefix + ".")), None)


def walk_problems(stops: list[str], graph: grimp.ImportGraph) -> list[str]:
    """What is wrong with a walk: more than ten stops, a stop outside the rooms, a room left out or gone
    back to, a module that does not exist, or a stop that no earlier stop of its room (for a room's first
    stop, the stop before it) reaches by imports; the worker's first stop excepted: the worker is reached
    over its socket."""
    problems = []
    if len(stops) > MAX_STOPS:
        problems.append(f"{len(stops)} stops")
    rooms = [room(m) for m in stops]
    if None in rooms:
        problems.append(f"outside the rooms: {[m for m, r in zip(stops, rooms, strict=True) if r is None]}")
    elif rooms != sorted(rooms) or set(rooms) != {0, 1, 2}:
        problems.append(f"rooms out of order or missing: {rooms}")
    for i, stop in enumerate(stops):
        if stop not in graph.modules:
            problems.append(f"no module {stop}")
            continue
        if i == 0 or (rooms[i] == 2 and rooms[i - 1] != 2):
            continue
        same_room = [s for s in stops[:i] if room(s) == rooms[i]]
        sources = same_room or stops[i - 1 : i]  # a room's first stop: from the last stop before it
        if not any(graph.find_shortest_chain(s, stop) is not None for s in sources):
            problems.append(f"{stop} is not reached by imports from a stop before it")
    return problems


@pytest.mark.parametrize("heading", ["gRPC ModelInfer", "HTTP infer", "OpenAI embeddings"])
def test_a_walk_stops_in_at_most_ten_files_through_three_rooms_in_order(heading: str) -> None:
    stops = walk(heading)
    assert len(stops) >= 3, stops
    assert walk_problems(stops, grimp.build_graph("mpsd")) == []


def test_a_walk_that_goes_back_a_room_skips_one_or_passes_ten_stops_is_refused() -> None:
    graph = grimp.build_graph("mpsd")
    good = walk("HTTP infer")
    assert walk_problems(good + good[-1:], graph) == ["11 stops"]
    assert walk_problems([good[0], good[-1], good[4]], graph)[0] == "rooms out of order or missing: [0, 2, 1]"
    assert walk_problems([good[0], "mpsd.daemon.core.registry", good[-1]], graph)[0].startswith("outside")
    plane, channel = "mpsd.daemon.dataplane.plane", "mpsd.daemon.dataplane.channel"
    assert walk_problems([good[0], channel, plane, good[-1]], graph) == [
        f"{plane} is not reached by imports from a stop before it"
    ]
