"""Reading one model config file: parsing, validation, and each problem as an Issue (file, field,
problem) that the daemon's reasons and `mpsd validate` both use. Shared by the YAML reader and the
config.pbtxt mapping, so neither imports the other."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import ValidationError
from pydantic_core import ErrorDetails

from mpsd.config.model_config import ModelConfig, error_loc
from mpsd.errors import Issue, ModelConfigError


def error_text(err: ErrorDetails) -> str:
    """What one validation error says, in the words the reasons and `mpsd validate` use."""
    if err["type"] == "extra_forbidden":
        return "unknown field"
    if err["type"] == "missing":
        return "required field is missing"
    return err["msg"].removeprefix("Value error, ")


def format_validation_error(path: Path, exc: ValidationError) -> str:
    """One line per problem, each naming the file and the field."""
    problems = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in error_loc(err)) or "(top level)"
        problems.append(f"{path}: field '{loc}': {error_text(err)}")
    return "; ".join(problems)


def validation_issues(path: Path, exc: ValidationError) -> tuple[Issue, ...]:
    """The problems of `format_validation_error` as data; a broken rule is placed at the field it names."""
    return tuple(Issue(str(path), error_loc(err), error_text(err)) for err in exc.errors())


def yaml_issue(path: Path, exc: yaml.YAMLError) -> Issue:
    """The file, where in it, and what the YAML parser disliked."""
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    return Issue(str(path), (), f"invalid YAML{where}: {problem}")


def config_problem(issue: Issue) -> ModelConfigError:
    """The error for one problem of a model config, its message the problem in words."""
    return ModelConfigError(str(issue), issues=(issue,))


def parse_model_config(path: Path, text: str, dir_name: str | None) -> ModelConfig:
    """Parse and validate a config.yaml; raises ModelConfigError (a ValueError) naming file and field."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise config_problem(yaml_issue(path, exc)) from None
    if raw is None:
        raise config_problem(Issue(str(path), (), "file is empty; it must hold the model's config fields"))
    if not isinstance(raw, dict):
        problem = f"expected a mapping of config fields, got {type(raw).__name__}"
        raise config_problem(Issue(str(path), (), problem))
    config = validate_model_config(path, raw)
    check_config_name(path, config, dir_name)
    return config


def validate_model_config(path: Path, raw: dict[str, object]) -> ModelConfig:
    """Validate config fields read from `path` (YAML or mapped from pbtxt); the ModelConfigError (a
    ValueError) names each field."""
    try:
        return ModelConfig.model_validate(raw)
    except ValidationError as exc:
        raise ModelConfigError(
            format_validation_error(path, exc), issues=validation_issues(path, exc)
        ) from None


def check_config_name(path: Path, config: ModelConfig, dir_name: str | None) -> None:
    """A config's name, when given, is its directory's (None: a file converted on its own, no check)."""
    if config.name is not None and dir_name is not None and config.name != dir_name:
        problem = f"'{config.name}' does not match the model directory '{dir_name}'"
        raise config_problem(Issue(str(path), ("name",), problem))
