"""Triton's ModelConfig as JSON (the `config` parameter of a load request) as mpsd's ModelConfig.

The JSON is protobuf's JSON form of model_config.proto, read as Triton reads it (unknown fields refused,
enum names in any case), then mapped and validated exactly as a config.pbtxt is (`pbtxt.py`), so a config
sent with a load means what the same config in the repository means.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from google.protobuf import json_format, text_format  # type: ignore[import-untyped]

from mpsd.config.model_config import ModelConfig
from mpsd.config.model_file import config_problem, validate_model_config
from mpsd.config.pbtxt import message_to_dict
from mpsd.errors import Issue, ModelConfigError
from mpsd.proto import model_config_pb2 as mc

LABEL = Path("config")  # what a problem's file is: the load request's parameter, not a file


def _repeated(field: Any) -> bool:
    flag = getattr(field, "is_repeated", None)  # protobuf 6 and later; `label` before
    return bool(flag) if flag is not None else field.label == field.LABEL_REPEATED


def _upper_enums(value: Any, descriptor: Any) -> Any:
    """Enum names upper-cased, as Triton parses them (case-insensitive enums): `"kind": "kind_cpu"` is
    KIND_CPU. Anything that is not where the descriptor expects it is left for the parser to refuse."""
    if not isinstance(value, dict):
        return value
    fields = {**descriptor.fields_by_name, **{f.json_name: f for f in descriptor.fields}}
    out: dict[str, Any] = {}
    for key, item in value.items():
        field = fields.get(key)
        out[key] = item if field is None else _field_value(item, field)
    return out


def _field_value(item: Any, field: Any) -> Any:
    if field.type == field.TYPE_MESSAGE and field.message_type.GetOptions().map_entry:
        value_field = field.message_type.fields_by_name["value"]
        return {k: _one_value(v, value_field) for k, v in item.items()} if isinstance(item, dict) else item
    if _repeated(field) and isinstance(item, list):
        return [_one_value(v, field) for v in item]
    return _one_value(item, field)


def _one_value(item: Any, field: Any) -> Any:
    if field.type == field.TYPE_ENUM and isinstance(item, str):
        return item.upper()
    if field.type == field.TYPE_MESSAGE:
        return _upper_enums(item, field.message_type)
    return item


def json_to_dict(text: str) -> tuple[dict[str, Any], tuple[str, ...], str]:
    """The config.yaml fields equivalent to a JSON ModelConfig, the ignored fields, and the message in
    Triton's text format (a config.pbtxt of the same config)."""
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise config_problem(Issue("", (), f"invalid JSON: {exc}")) from None
    if not isinstance(raw, dict):
        raise config_problem(Issue("", (), f"expected a JSON object, got {type(raw).__name__}"))
    try:
        msg = json_format.ParseDict(_upper_enums(raw, mc.ModelConfig.DESCRIPTOR), mc.ModelConfig())
    except json_format.ParseError as exc:
        problem = " ".join(str(exc).split())  # protobuf's message spans lines
        raise config_problem(Issue("", (), f"not a ModelConfig: {problem}")) from None
    fields, warnings = message_to_dict(msg)
    return fields, warnings, str(text_format.MessageToString(msg))


def parse_json_config(
    text: str, model: str, base: ModelConfig | None = None
) -> tuple[ModelConfig, tuple[str, ...], str]:
    """Parse and validate a JSON ModelConfig for model `model`: the config, the ignored fields and the
    config.pbtxt it stands for. With `base` (the model's repository config), the fields the JSON leaves out
    keep their values there, as Triton completes a partial config from the model. The ModelConfigError (a
    ValueError) names each field, its issues without a file (`Issue.file` is "")."""
    raw, warnings, written = json_to_dict(text)
    if base is not None:
        raw = {**base.model_dump(exclude_defaults=True), **raw}
    try:
        config = validate_model_config(LABEL, raw)
    except ModelConfigError as exc:
        issues = tuple(Issue("", i.loc, i.problem) for i in exc.issues)
        raise ModelConfigError("; ".join(str(i) for i in issues), issues=issues) from None
    if config.name is not None and config.name != model:  # an empty name is the model's, as in Triton
        raise config_problem(Issue("", ("name",), f"'{config.name}' is not the model loaded, '{model}'"))
    return config, warnings, written
