"""`mpsd validate`: find every mistake in a model repository before a daemon is started on it.

The daemon stops at the first problem of a model and shows it as that model's UNAVAILABLE reason; this
reports all of them at once, each with the file, the field, the line where it is known, and a fix. The
checks are the daemon's own (schema, repository scan, placement rules, and with `--load` the worker's
backends and warm-up on the CPU), so a repository that passes here loads in the daemon, apart from what
only the serving host can tell: whether its devices work and whether all models fit on them together.
"""

from __future__ import annotations

import difflib
import json
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from mpsd.config.model_config import DEFAULT_FILENAMES, Backend, DataType, Kind, ModelConfig, error_loc
from mpsd.config.repository import (
    CONFIG_FILE,
    MODEL_NAME_RE,
    PBTXT_FILE,
    ModelSource,
    config_path,
    error_text,
    is_ignored_name,
    load_model_source,
    yaml_issue,
)
from mpsd.errors import ConfigError, Issue
from mpsd.ipc.dtypes import wire_to_config
from mpsd.tools.common import ToolError
from mpsd.tools.trial import TrialError, load_and_warm_up

DOCS = "docs/configuration.md"
BACKEND_BY_SUFFIX = {".pt": "torchscript", ".pt2": "torch_export", ".py": "python"}

# Hints by the name of the field a problem is about.
FIELD_HINTS: dict[str, str] = {
    "dims": "sizes are positive integers and -1 marks a variable size; leave out the batch dimension "
    "(max_batch_size > 0 adds it)",
    "data_type": "one of " + ", ".join(get_args(DataType)),
    "kind": "one of " + ", ".join(get_args(Kind)),
    "backend": "torchscript (reads model.pt), torch_export (model.pt2) or python (model.py)",
    "max_batch_size": "0 turns batching off; N > 0 makes the first dimension of every input and output the "
    "batch, up to N",
    "count": "1 to 64 worker processes per instance group",
    "gpus": "a list of distinct CUDA GPU indices, e.g. [0, 1]",
    "memory_fraction": "see docs/devices.md for the range on each device",
    "version_policy": "one of latest: {num_versions: N}, all: {} or specific: {versions: [1, 3]}",
    "parameters": "a mapping of names to string values",
    "input": "a list of {name, data_type, dims} entries",
    "output": "a list of {name, data_type, dims} entries",
    "optional": "true or false",
    "dynamic_batching": "needs max_batch_size > 0",
}

LITERALS: dict[str, tuple[str, ...]] = {
    "data_type": get_args(DataType),
    "kind": get_args(Kind),
    "backend": get_args(Backend),
}


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


# ---- locating fields ---------------------------------------------------------------------------------


def field_path(loc: Sequence[int | str]) -> str:
    """`('input', 0, 'dims')` -> `input[0].dims`, the way a reader finds it in the YAML."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def schema_at(loc: Sequence[int | str]) -> type[BaseModel] | None:
    """The pydantic model that describes the mapping at `loc` inside a ModelConfig (None if not a mapping)."""
    model: type[BaseModel] = ModelConfig
    for part in loc:
        if isinstance(part, int):
            continue
        info = model.model_fields.get(part)
        if info is None:
            return None
        inner = _model_in(info.annotation)
        if inner is None:
            return None
        model = inner
    return model


def line_of(text: str, loc: Sequence[int | str]) -> int | None:
    """The 1-based line where the value (or the unknown key) at `loc` is written, when it can be found."""
    try:
        node: Any = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return None
    if node is None:
        return None
    line: int = node.start_mark.line + 1
    for part in loc:
        if isinstance(node, yaml.MappingNode) and isinstance(part, str):
            match = [(k, v) for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == part]
            if not match:
                return line
            key, node = match[0]
            line = key.start_mark.line + 1
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return line
    return line


# ---- hints -------------------------------------------------------------------------------------------


def _last_name(loc: Sequence[int | str]) -> str:
    names = [p for p in loc if isinstance(p, str)]
    return names[-1] if names else ""


def hint_for(err: ErrorDetails, loc: Sequence[int | str]) -> str:
    """A fix for one schema error: the closest known field for a typo, the allowed values otherwise."""
    name = _last_name(loc)
    if err["type"] == "extra_forbidden":
        parent = schema_at(loc[:-1])
        known = sorted(parent.model_fields) if parent is not None else []
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        if close:
            return f"did you mean '{close[0]}'? (unknown fields are refused, not ignored)"
        return f"remove it; the fields allowed here are {', '.join(known)}"
    if err["type"] == "missing":
        extra = FIELD_HINTS.get(name)
        return f"add '{name}'" + (f": {extra}" if extra else f" (see {DOCS})")
    if len(loc) == 1 and name == "name":
        return "leave 'name' out, or make it equal to the model's directory name"
    allowed = LITERALS.get(name)
    given = err.get("input")
    if err["type"] == "literal_error" and allowed and isinstance(given, str):
        close = difflib.get_close_matches(given.upper(), allowed, n=1, cutoff=0.5)
        if close:
            return f"did you mean '{close[0]}'? ({FIELD_HINTS[name]})"
    return FIELD_HINTS.get(name, f"see {DOCS} for the field's type and allowed values")


def _schema_problems(model: str, cfg_path: Path, text: str, exc: ValidationError) -> list[Problem]:
    problems = []
    for err in exc.errors():
        loc = error_loc(err)  # a rule across fields is placed at the field it is about
        problems.append(
            Problem(
                model, str(cfg_path), field_path(loc), error_text(err), hint_for(err, loc), line_of(text, loc)
            )
        )
    return problems


# ---- one model -----------------------------------------------------------------------------------------


def _is_version_name(name: str) -> bool:
    return name.isascii() and name.isdigit() and str(int(name)) == name


def _missing_file_hint(config: ModelConfig, version_dir: Path) -> str:
    expected = config.model_filename
    try:
        present = sorted(p.name for p in version_dir.iterdir() if p.is_file() and not is_ignored_name(p.name))
    except OSError:
        present = []
    for name in present:
        backend = BACKEND_BY_SUFFIX.get(Path(name).suffix)
        if backend is not None and backend != config.backend and name == DEFAULT_FILENAMES[backend]:
            return f"found {name}: set `backend: {backend}`"
    candidates = [n for n in present if BACKEND_BY_SUFFIX.get(Path(n).suffix) == config.backend]
    if candidates:
        found = candidates[0]
        return f"found {found}: rename it to {expected} or set `default_model_filename: {found}`"
    return f"copy the model file to {version_dir / expected} (backend {config.backend} reads {expected})"


def _issue_problem(name: str, issue: Issue, text: str = "", file: str = "") -> Problem:
    """One problem the daemon's own checks found, from the issue they raised (`file` where it has none)."""
    hint = FIELD_HINTS.get(_last_name(issue.loc), f"see {DOCS}")
    line = line_of(text, issue.loc) if text else None
    return Problem(name, issue.file or file, field_path(issue.loc), issue.problem, hint, line)


def _placement_problems(name: str, cfg_path: Path, text: str, exc: ConfigError) -> list[Problem]:
    issues = exc.issues or (_placement_issue(exc.message),)
    return [_issue_problem(name, issue, text, str(cfg_path)) for issue in issues]


def _placement_issue(message: str) -> Issue:
    """The issue of a placement ConfigError raised without one: its message reads `[model 'x': ]field:
    problem`, taken apart here until mpsd.daemon.supervise.placement attaches the issue itself."""
    message = re.sub(r"^model '[^']*': ", "", message)
    match = re.match(r"^([A-Za-z_][\w.\[\]]*): (.*)$", message, re.DOTALL)
    path, problem = (match.group(1), match.group(2)) if match else ("", message)
    loc = [int(p[1:-1]) if p.startswith("[") else p for p in re.findall(r"[A-Za-z_]\w*|\[\d+\]", path)]
    return Issue("", tuple(loc), problem)


def _source_problems(name: str, source: ModelSource) -> list[Problem]:
    """The daemon's own verdict on a model directory, one problem per issue it found."""
    if not source.issues:  # no reason as data: show the reason as it is
        return [Problem(name, "", "", source.error or "invalid config", f"see {DOCS}")]
    return [_issue_problem(name, issue) for issue in source.issues]


def _read_yaml_config(name: str, cfg_path: Path, report: ModelReport) -> tuple[ModelConfig, str] | None:
    """The config and its text, or None with every problem of the file recorded in the report."""
    add = report.problems.append
    try:
        text = cfg_path.read_text()
    except FileNotFoundError:
        add(
            Problem(
                name,
                str(cfg_path),
                "",
                "file is missing",
                f"write one (see {DOCS}), or let `mpsd init-model {name} --from MODEL_FILE` write it",
            )
        )
        return None
    except (OSError, UnicodeDecodeError) as exc:
        add(Problem(name, str(cfg_path), "", f"cannot read it: {exc}", "the config must be UTF-8 YAML text"))
        return None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        add(
            Problem(
                name,
                str(cfg_path),
                "",
                yaml_issue(cfg_path, exc).problem,
                "fix the YAML syntax there (unclosed brackets and tabs used for indentation are common)",
                mark.line + 1 if mark is not None else None,
            )
        )
        return None
    if not isinstance(raw, dict):
        hint = f"see {DOCS} for an example"
        add(Problem(name, str(cfg_path), "", "expected a mapping of config fields", hint))
        return None
    try:
        return ModelConfig.model_validate(raw), text
    except ValidationError as exc:
        report.problems.extend(_schema_problems(name, cfg_path, text, exc))
        return None


def check_model(model_dir: Path, allow_symlinks: bool = False) -> tuple[ModelReport, ModelSource | None]:
    """Every problem of one model directory that can be found without loading it."""
    from mpsd.daemon.supervise.placement import plan_instances

    name = model_dir.name
    report = ModelReport(name, str(model_dir))
    add = report.problems.append
    if not MODEL_NAME_RE.match(name):
        hint = "use letters, digits, '_', '.' and '-' (not first), at most 128 characters"
        add(Problem(name, str(model_dir), "", f"invalid model name '{name}'", hint))
        return report, None
    cfg_path, conflict = config_path(model_dir)
    if conflict is not None:
        add(Problem(name, str(model_dir), "", conflict.problem, "remove one of them"))
        return report, None
    source = load_model_source(model_dir, allow_symlinks)
    report.warnings = list(source.warnings)
    text = ""
    if cfg_path.name == PBTXT_FILE:  # Triton's format: the daemon's reader gives the verdict
        if source.config is None:
            report.problems.extend(_source_problems(name, source))
            return report, None
        config = source.config
    else:
        parsed = _read_yaml_config(name, cfg_path, report)
        if parsed is None:
            return report, None
        config, text = parsed
    if config.name is not None and config.name != name:
        add(
            Problem(
                name,
                str(cfg_path),
                "name",
                f"'{config.name}' does not match the model directory '{name}'",
                "leave 'name' out, or make it equal to the model's directory name",
                line_of(text, ("name",)),
            )
        )
    try:
        plan_instances(config)
    except ConfigError as exc:
        report.problems.extend(_placement_problems(name, cfg_path, text, exc))

    available = sorted(int(p.name) for p in model_dir.iterdir() if p.is_dir() and _is_version_name(p.name))
    selected = config.version_policy.select(available)
    if not available:
        where = model_dir / "1" / config.model_filename
        add(Problem(name, str(model_dir), "", "no version directory", f"put the model file into {where}"))
    elif not selected:
        add(
            Problem(
                name,
                str(cfg_path),
                "version_policy",
                f"selects none of the versions present ({', '.join(map(str, available))})",
                FIELD_HINTS["version_policy"],
                line_of(text, ("version_policy",)),
            )
        )
    report.versions = selected
    for v in selected:
        model_file = model_dir / str(v) / config.model_filename
        if not model_file.is_file():
            add(
                Problem(
                    name,
                    str(model_file),
                    "default_model_filename" if config.default_model_filename else "backend",
                    "model file is missing",
                    _missing_file_hint(config, model_dir / str(v)),
                )
            )
    if source.error is not None and not report.problems:  # the daemon's own verdict always counts
        report.problems.extend(_source_problems(name, source))
    return report, (source if source.ok and report.ok else None)


# ---- loading -------------------------------------------------------------------------------------------

LOAD_HINTS = {
    "torchscript": "model.pt must be written by torch.jit.save (a scripted or traced module), not torch.save",
    "torch_export": "model.pt2 must be written by torch.export.save from the same major PyTorch version",
    "python": "model.py must define `class Model` with __init__(self, config, device) and "
    "infer(self, inputs)",
}


def _index_of(tensors: Sequence[Any], name: str) -> int | None:
    return next((i for i, t in enumerate(tensors) if t.name == name), None)


def _trial_problems(source: ModelSource, version: int, error: TrialError) -> list[Problem]:
    config = source.config
    assert config is not None
    model_file = str(source.path / str(version) / config.model_filename)
    cfg_path = config_path(source.path)[0]
    cfg_file = str(cfg_path)
    text = cfg_path.read_text() if cfg_path.name == CONFIG_FILE else ""  # lines are found in YAML only
    if error.stage == "load":
        hint = LOAD_HINTS[config.backend]
        return [Problem(source.name, model_file, "", f"cannot load: {error.message}", hint)]
    if error.stage == "run":
        return [
            Problem(
                source.name,
                model_file,
                "input",
                f"the model failed on the warm-up inputs: {error.message}",
                "the warm-up feeds zeros shaped like the input dims (batch 1 when batching, -1 as 1): check "
                "the inputs' order, dims and data_type against the model's forward()",
                line_of(text, ("input",)),
            )
        ]
    problems = []
    for mismatch in error.mismatches:
        index = _index_of(config.output, mismatch.output)
        if index is None:
            problems.append(Problem(source.name, cfg_file, "output", mismatch.message, f"see {DOCS}"))
            continue
        if mismatch.shape is not None:
            got = list(mismatch.shape)
            dims = got[1:] if config.max_batch_size > 0 else got
            loc: tuple[int | str, ...] = ("output", index, "dims")
            hint = f"set dims: {dims}"
            if config.max_batch_size > 0:
                hint += " (the batch dimension is left out)"
        else:
            loc = ("output", index, "data_type")
            hint = f"set data_type: {wire_to_config(str(mismatch.datatype))}, or change the model"
        problems.append(
            Problem(source.name, cfg_file, field_path(loc), mismatch.message, hint, line_of(text, loc))
        )
    return problems


Progress = Callable[[str], None]


def _stderr_progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def load_models(
    sources: Sequence[tuple[ModelReport, ModelSource]], progress: Progress = _stderr_progress
) -> None:
    """Load every version of each model on the CPU and warm it up, recording problems in its report."""
    total = sum(len(source.versions) for _, source in sources)
    done = 0
    for report, source in sources:
        loaded = True
        for v in source.versions:
            done += 1
            assert source.config is not None
            label = f"[{done}/{total}] {source.name} version {v}"
            progress(f"{label}: loading ({source.config.backend}) and warming up on the CPU")
            t0 = time.perf_counter()
            try:
                load_and_warm_up(source, v)
            except TrialError as exc:
                loaded = False
                report.problems.extend(_trial_problems(source, v, exc))
                progress(f"{label}: failed ({exc.stage})")
            else:
                progress(f"{label}: ok ({time.perf_counter() - t0:.1f} s)")
        report.loaded = loaded


# ---- the command -------------------------------------------------------------------------------------


def check_repository(
    repo: Path, load: bool, allow_symlinks: bool = False, progress: Progress = _stderr_progress
) -> list[ModelReport]:
    """Reports for every model directory, in the order the daemon scans them."""
    if not repo.is_dir():
        raise ToolError(
            f"{repo} is not a directory", "pass the model repository: a folder with one folder per model"
        )
    reports: list[ModelReport] = []
    loadable: list[tuple[ModelReport, ModelSource]] = []
    for entry in sorted(repo.iterdir()):
        if entry.is_dir() and not is_ignored_name(entry.name):
            report, source = check_model(entry, allow_symlinks)
            reports.append(report)
            if source is not None:
                loadable.append((report, source))
    if load and loadable:
        load_models(loadable, progress)
    return reports


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


def run(repo: Path, load: bool, json_output: bool, allow_symlinks: bool = False) -> int:
    """Exit status 0 only when every model is valid (and, with `load`, loads and warms up)."""
    reports = check_repository(repo, load, allow_symlinks)
    ok = bool(reports) and all(r.ok for r in reports)
    if json_output:
        print(json.dumps(as_json(repo, reports, load), indent=2))
    else:
        print(render(repo, reports, load))
    return 0 if ok else 1
