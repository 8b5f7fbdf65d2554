"""`mpsd validate`: find every mistake in a model repository before a daemon is started on it.

The daemon stops at the first problem of a model and shows it as that model's UNAVAILABLE reason; this
reports all of them at once, each with the file, the field, the line where it is known, and a fix. The
checks are the daemon's own (schema, repository scan, placement rules, and with `--load` the worker's
backends and warm-up on the CPU), so a repository that passes here loads in the daemon, apart from what
only the serving host can tell: whether its devices work and whether all models fit on them together.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import ValidationError

from mpsd.config.model_config import DEFAULT_FILENAMES, ModelConfig, error_loc
from mpsd.config.model_file import error_text, yaml_issue
from mpsd.config.repository import (
    MODEL_NAME_RE,
    PBTXT_FILE,
    ModelSource,
    config_path,
    is_ignored_name,
    load_model_source,
)
from mpsd.errors import ConfigError, Issue
from mpsd.tools.common import ToolError
from mpsd.tools.validate_ensemble import Checked, Ensemble, step_problems
from mpsd.tools.validate_fields import DOCS, FIELD_HINTS, field_path, hint_for, last_name, line_of
from mpsd.tools.validate_load import Progress, load_models, stderr_progress
from mpsd.tools.validate_report import ModelReport, Problem, as_json, render

BACKEND_BY_SUFFIX = {".pt": "torchscript", ".pt2": "torch_export", ".py": "python"}


def _backend_of(name: str) -> str | None:
    """The backend a file's name suggests (an AOTInductor package is a .aoti.pt2 file)."""
    return "aoti" if name.endswith(".aoti.pt2") else BACKEND_BY_SUFFIX.get(Path(name).suffix)


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
        backend = _backend_of(name)
        if backend is not None and backend != config.backend and name == DEFAULT_FILENAMES[backend]:
            return f"found {name}: set `backend: {backend}`"
    candidates = [n for n in present if _backend_of(n) == config.backend]
    if candidates:
        found = candidates[0]
        return f"found {found}: rename it to {expected} or set `default_model_filename: {found}`"
    return f"copy the model file to {version_dir / expected} (backend {config.backend} reads {expected})"


def _issue_problem(name: str, issue: Issue, text: str = "", file: str = "") -> Problem:
    """One problem the daemon's own checks found, from the issue they raised (`file` where it has none)."""
    hint = FIELD_HINTS.get(last_name(issue.loc), f"see {DOCS}")
    line = line_of(text, issue.loc) if text else None
    return Problem(name, issue.file or file, field_path(issue.loc), issue.problem, hint, line)


def _placement_problems(name: str, cfg_path: Path, text: str, exc: ConfigError) -> list[Problem]:
    issues = exc.issues or (Issue("", (), exc.message),)
    return [_issue_problem(name, issue, text, str(cfg_path)) for issue in issues]


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


@dataclass(frozen=True)
class ModelCheck:
    """One model directory checked: its report, the source to load when it passed, and what was read of
    its config (an ensemble's steps are checked against the other models' configs)."""

    report: ModelReport
    loadable: ModelSource | None
    config: ModelConfig | None = None
    cfg_path: Path | None = None
    text: str = ""


def check_model(
    model_dir: Path, allow_symlinks: bool = False, op_library_dirs: Sequence[Path] = ()
) -> ModelCheck:
    """Every problem of one model directory that can be found without loading it (an ensemble's steps are
    checked by check_repository, which sees the other models)."""
    name = model_dir.name
    report = ModelReport(name, str(model_dir))
    add = report.problems.append
    if not MODEL_NAME_RE.match(name):
        hint = "use letters, digits, '_', '.' and '-' (not first), at most 128 characters"
        add(Problem(name, str(model_dir), "", f"invalid model name '{name}'", hint))
        return ModelCheck(report, None)
    cfg_path, conflict = config_path(model_dir)
    if conflict is not None:
        add(Problem(name, str(model_dir), "", conflict.problem, "remove one of them"))
        return ModelCheck(report, None)
    source = load_model_source(model_dir, allow_symlinks, op_library_dirs)
    report.warnings = list(source.warnings)
    read = _read_checked_config(name, cfg_path, source, report)
    if read is None:
        return ModelCheck(report, None)
    config, text = read
    report.problems.extend(_name_problems(name, cfg_path, text, config))
    report.problems.extend(_placement_and_budget_problems(name, cfg_path, text, config))
    report.versions, problems = _version_problems(model_dir, cfg_path, text, config)
    report.problems.extend(problems)
    if source.error is not None and not report.problems:  # the daemon's own verdict always counts
        report.problems.extend(_source_problems(name, source))
    return ModelCheck(report, source if source.ok and report.ok else None, config, cfg_path, text)


def _read_checked_config(
    name: str, cfg_path: Path, source: ModelSource, report: ModelReport
) -> tuple[ModelConfig, str] | None:
    """The config and its YAML text (none for a config.pbtxt), or None with why not in the report.

    A config.pbtxt is Triton's format: the daemon's own reader (in `source`) gives the verdict. A
    config.yaml is read here, to name each problem's field and line."""
    if cfg_path.name != PBTXT_FILE:
        return _read_yaml_config(name, cfg_path, report)
    if source.config is None:
        report.problems.extend(_source_problems(name, source))
        return None
    return source.config, ""


def _name_problems(name: str, cfg_path: Path, text: str, config: ModelConfig) -> list[Problem]:
    if config.name is None or config.name == name:
        return []
    return [
        Problem(
            name,
            str(cfg_path),
            "name",
            f"'{config.name}' does not match the model directory '{name}'",
            "leave 'name' out, or make it equal to the model's directory name",
            line_of(text, ("name",)),
        )
    ]


def _placement_and_budget_problems(
    name: str, cfg_path: Path, text: str, config: ModelConfig
) -> list[Problem]:
    """What placing the model's instances refuses, and the memory budget it is over by itself: the daemon
    refuses that whatever runs beside it."""
    from mpsd.daemon.supervise.placement import check_memory_budget, plan_instances

    try:
        plans = plan_instances(config)
    except ConfigError as exc:
        return _placement_problems(name, cfg_path, text, exc)
    hint = (
        "lower memory_fraction or count: the fractions on one device add up to at most 1.0, or "
        "the daemon (memory_budget_policy: refuse, the default) does not load the model"
    )
    line = line_of(text, ("instance_group",))
    return [
        Problem(name, str(cfg_path), "instance_group", message, hint, line)
        for message in check_memory_budget({name: plans})
    ]


def _version_problems(
    model_dir: Path, cfg_path: Path, text: str, config: ModelConfig
) -> tuple[list[int], list[Problem]]:
    """The versions the policy selects, and what is wrong with them: none present, none selected, or a
    selected version without its model file (an ensemble's version folders are empty)."""
    name = model_dir.name
    problems: list[Problem] = []
    available = sorted(int(p.name) for p in model_dir.iterdir() if p.is_dir() and _is_version_name(p.name))
    selected = config.version_policy.select(available)
    if not available:
        where = model_dir / "1" / config.model_filename
        hint = f"put the model file into {where}"
        if config.backend == "ensemble":
            hint = f"make the (empty) folder {model_dir / '1'}"
        problems.append(Problem(name, str(model_dir), "", "no version directory", hint))
    elif not selected:
        problems.append(
            Problem(
                name,
                str(cfg_path),
                "version_policy",
                f"selects none of the versions present ({', '.join(map(str, available))})",
                FIELD_HINTS["version_policy"],
                line_of(text, ("version_policy",)),
            )
        )
    for v in selected if config.backend != "ensemble" else ():
        model_file = model_dir / str(v) / config.model_filename
        if not model_file.is_file():
            problems.append(
                Problem(
                    name,
                    str(model_file),
                    "default_model_filename" if config.default_model_filename else "backend",
                    "model file is missing",
                    _missing_file_hint(config, model_dir / str(v)),
                )
            )
    return selected, problems


# ---- the command -------------------------------------------------------------------------------------


def check_repository(
    repo: Path,
    load: bool,
    allow_symlinks: bool = False,
    progress: Progress = stderr_progress,
    op_library_dirs: Sequence[Path] = (),
) -> list[ModelReport]:
    """Reports for every model directory, in the order the daemon scans them."""
    if not repo.is_dir():
        raise ToolError(
            f"{repo} is not a directory", "pass the model repository: a folder with one folder per model"
        )
    checks = [
        check_model(entry, allow_symlinks, op_library_dirs)
        for entry in sorted(repo.iterdir())
        if entry.is_dir() and not is_ignored_name(entry.name)
    ]
    models = {c.report.name: Checked(c.config, c.report.versions) for c in checks}
    loadable: list[tuple[ModelReport, ModelSource]] = []
    for c in checks:
        if c.config is not None and c.config.backend == "ensemble" and c.cfg_path is not None:
            c.report.problems.extend(
                step_problems(Ensemble(c.report.name, c.cfg_path, c.text, c.config), models)
            )
        elif c.loadable is not None:  # an ensemble has nothing to load: its steps' models load
            loadable.append((c.report, c.loadable))
    reports = [c.report for c in checks]
    if load and loadable:
        load_models(loadable, progress)
    return reports


def run(
    repo: Path,
    load: bool,
    json_output: bool,
    allow_symlinks: bool = False,
    op_library_dirs: Sequence[Path] = (),
) -> int:
    """Exit status 0 only when every model is valid (and, with `load`, loads and warms up)."""
    reports = check_repository(repo, load, allow_symlinks, op_library_dirs=op_library_dirs)
    ok = bool(reports) and all(r.ok for r in reports)
    if json_output:
        print(json.dumps(as_json(repo, reports, load), indent=2))
    else:
        print(render(repo, reports, load))
    return 0 if ok else 1
