"""Where a field of a model's config.yaml is written (its path and line) and the fix to suggest for it,
for the problems `mpsd validate` reports."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any, get_args

import yaml
from pydantic import BaseModel
from pydantic_core import ErrorDetails

from mpsd.config.model_config import Backend, DataType, Kind, ModelConfig

DOCS = "docs/configuration.md"

# Hints by the name of the field a problem is about.
FIELD_HINTS: dict[str, str] = {
    "dims": "sizes are positive integers and -1 marks a variable size; leave out the batch dimension "
    "(max_batch_size > 0 adds it)",
    "data_type": "one of " + ", ".join(get_args(DataType)),
    "kind": "one of " + ", ".join(get_args(Kind)),
    "backend": "torchscript (reads model.pt), torch_export (model.pt2), aoti (model.aoti.pt2) or python "
    "(model.py)",
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


def last_name(loc: Sequence[int | str]) -> str:
    names = [p for p in loc if isinstance(p, str)]
    return names[-1] if names else ""


def hint_for(err: ErrorDetails, loc: Sequence[int | str]) -> str:
    """A fix for one schema error: the closest known field for a typo, the allowed values otherwise."""
    name = last_name(loc)
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
