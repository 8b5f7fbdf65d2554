"""`mpsd validate` on an ensemble: it has no model file (its version folder is empty), so what can be
wrong is its steps, and those are checked against the repository's other models: each step's model is
there, the version it names is one the model serves, and its maps name that model's own inputs and outputs
(every input fed), as the daemon checks them when a request reaches the step."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from mpsd.config.model_config import ModelConfig
from mpsd.tools.validate_fields import DOCS, field_path, line_of
from mpsd.tools.validate_report import Problem


@dataclass(frozen=True)
class Checked:
    """What validate read of one model directory: its config (None where it could not be read) and the
    versions it serves."""

    config: ModelConfig | None
    versions: Sequence[int]


@dataclass(frozen=True)
class Ensemble:
    """An ensemble to check: its config and where it was written."""

    name: str
    cfg_path: Path
    text: str  # the YAML, to find lines in ("" for a config.pbtxt)
    config: ModelConfig


def step_problems(ensemble: Ensemble, models: Mapping[str, Checked]) -> list[Problem]:
    """Each step whose model, version or maps the repository's models do not match."""
    assert ensemble.config.ensemble_scheduling is not None
    problems: list[Problem] = []

    def add(index: int, field: str, problem: str, hint: str) -> None:
        loc = ("ensemble_scheduling", "step", index, field)
        where = line_of(ensemble.text, loc) if ensemble.text else None
        problems.append(Problem(ensemble.name, str(ensemble.cfg_path), field_path(loc), problem, hint, where))

    for i, step in enumerate(ensemble.config.ensemble_scheduling.step):
        model = step.model_name
        checked = models.get(model)
        if checked is None:
            hint = f"add the folder {model}/ to the repository, or name one of its models (see {DOCS})"
            add(i, "model_name", f"no model '{model}' in the repository", hint)
            continue
        config = checked.config
        if config is None:  # the model's own report says what is wrong with it
            continue
        if step.model_version > 0 and step.model_version not in checked.versions:
            served = ", ".join(map(str, checked.versions)) or "none"
            hint = "use -1 for the latest version, or one it serves"
            add(
                i, "model_version", f"model '{model}' serves no version {step.model_version} ({served})", hint
            )
        inputs = [t.name for t in config.input]
        outputs = [t.name for t in config.output]
        unknown = sorted(set(step.input_map) - set(inputs))
        unfed = [n for n in inputs if n not in step.input_map]
        if unknown or unfed:
            said = [f"names input(s) {', '.join(unknown)} the model does not have"] if unknown else []
            said += [f"does not feed input(s) {', '.join(unfed)}"] if unfed else []
            hint = f"map each input of model '{model}' ({', '.join(inputs)}) to an ensemble tensor"
            add(i, "input_map", "; ".join(said), hint)
        unmade = sorted(set(step.output_map) - set(outputs))
        if unmade:
            hint = f"map outputs of model '{model}' ({', '.join(outputs)})"
            add(i, "output_map", f"names output(s) {', '.join(unmade)} the model does not have", hint)
    return problems
