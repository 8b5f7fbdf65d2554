"""What `mpsd validate` found: one Problem per thing to fix, a report per model, and both printed as text
or JSON."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mpsd.config.repository import CONFIG_FILE


@dataclass(frozen=True)
class Problem:
    """One thing to fix: where (file, field, line) and how."""

    model: str
    file: str
    field: str
    problem: str
    hint: str
    line: int | None = None

    def render(self) -> str:
        where = self.file + (f":{self.line}" if self.line is not None else "")
        what = f"field '{self.field}': {self.problem}" if self.field else self.problem
        return f"{where}: {what}\n    hint: {self.hint}"


@dataclass
class ModelReport:
    name: str
    path: str
    versions: list[int] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # fields the daemon accepts but ignores
    loaded: bool | None = None  # None: not tried (no --load, or the config already has problems)

    @property
    def ok(self) -> bool:
        return not self.problems


def render(repo: Path, reports: Sequence[ModelReport], load: bool) -> str:
    problems = [p for r in reports for p in r.problems]
    lines = [p.render() for p in problems]
    lines += [f"{r.path}: warning: {w}" for r in reports for w in r.warnings]
    if not reports:
        lines.append(f"{repo}: no model directories (each model is a folder with a {CONFIG_FILE})")
    elif problems:
        bad = sum(1 for r in reports if not r.ok)
        lines += [
            "",
            f"{repo}: {len(problems)} problem{'s' if len(problems) != 1 else ''} in {bad} of "
            f"{len(reports)} models",
        ]
    else:
        how = " (each loaded and warmed up on the CPU)" if load else " (add --load to also load each model)"
        lines.append(f"{repo}: all {len(reports)} models are valid{how}")
    return "\n".join(lines)


def as_json(repo: Path, reports: Sequence[ModelReport], load: bool) -> dict[str, Any]:
    return {
        "repository": str(repo),
        "ok": bool(reports) and all(r.ok for r in reports),
        "loaded": load,
        "models": [
            {
                "name": r.name,
                "path": r.path,
                "versions": r.versions,
                "ok": r.ok,
                "loaded": r.loaded,
                "warnings": r.warnings,
            }
            for r in reports
        ],
        "problems": [asdict(p) for r in reports for p in r.problems],
    }
