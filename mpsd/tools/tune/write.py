"""`mpsd tune --write`: the chosen settings into the model's config file, in the format it is in.

Only the searched fields change; everything else stays as written (comments aside: the file is written
again by the YAML or protobuf text writer). The new text is validated as the daemon reads it before it
replaces the old file, by a rename, so the daemon never sees half a file."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from mpsd.errors import ModelConfigError
from mpsd.tools.common import ToolError
from mpsd.tools.tune.overrides import override
from mpsd.tools.tune.trials import Settings


def _yaml(path: Path, text: str, s: Settings, _batching: bool, graphs: bool) -> str:
    from mpsd.config.model_file import parse_model_config

    raw: dict[str, Any] = yaml.safe_load(text)
    raw.update(override(raw, s, graphs))  # the searched fields, as a trial's load sets them
    new = yaml.safe_dump(raw, sort_keys=False)
    parse_model_config(path, new, path.parent.name)
    return new


def _pbtxt(path: Path, text: str, s: Settings, batching: bool, graphs: bool) -> str:
    from google.protobuf import text_format  # type: ignore[import-untyped]

    from mpsd.config.pbtxt import parse_pbtxt_config
    from mpsd.proto import model_config_pb2 as mc

    msg = text_format.Parse(text, mc.ModelConfig())
    group = msg.instance_group[0] if msg.instance_group else msg.instance_group.add()
    group.count = s.instances
    if batching:
        msg.max_batch_size = s.max_batch_size
        msg.dynamic_batching.max_queue_delay_microseconds = s.delay_us
        del msg.dynamic_batching.preferred_batch_size[:]
        msg.dynamic_batching.preferred_batch_size.extend(s.preferred)
    if graphs:
        msg.optimization.cuda.graphs = s.cuda_graphs
    new = str(text_format.MessageToString(msg))
    parse_pbtxt_config(path, new, path.parent.name)
    return new


def write_settings(model_dir: Path, settings: Settings, batching: bool, graphs: bool) -> Path:
    """Write `settings` into the model's config.yaml or config.pbtxt; the path written."""
    from mpsd.config.repository import PBTXT_FILE, config_path

    path, conflict = config_path(model_dir)
    if conflict is not None or not path.is_file():
        raise ToolError(
            f"cannot write the settings: {conflict.problem if conflict else f'{path} does not exist'}",
            "pass --repository with the daemon's model repository",
        )
    writer = _pbtxt if path.name == PBTXT_FILE else _yaml
    try:
        new = writer(path, path.read_text(), settings, batching, graphs)
    except ModelConfigError as exc:
        raise ToolError(f"the tuned config does not validate: {exc.message}", "nothing was written") from None
    temporary = path.with_name(f".{path.name}.tune.tmp")
    temporary.write_text(new)
    os.replace(temporary, path)
    return path
