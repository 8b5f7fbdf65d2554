"""`mpsd convert-config`: a model's config.pbtxt as the equivalent config.yaml, and the reverse.

Conversion goes through the same validation as loading, so a file that converts cleanly also loads, and
fields the daemon would ignore are listed on stderr instead of vanishing from the output.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


def _source_file(path: Path) -> Path:
    """A config file, or the model directory holding exactly one."""
    from mpsd.config.model_file import config_problem
    from mpsd.config.repository import config_path

    if not path.is_dir():
        return path
    found, conflict = config_path(path)
    if conflict is not None:
        raise config_problem(conflict)
    return found


def convert(path: Path, to: str | None) -> tuple[str, tuple[str, ...]]:
    """The converted text and the warnings about ignored fields; ValueError says what is wrong."""
    from mpsd.config.model_file import parse_model_config
    from mpsd.config.pbtxt import parse_pbtxt_config
    from mpsd.config.pbtxt_write import config_to_pbtxt
    from mpsd.config.repository import PBTXT_FILE

    source = _source_file(path)
    try:
        text = source.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{source}: cannot read: {exc}") from None
    from_pbtxt = source.suffix == Path(PBTXT_FILE).suffix
    target = to or ("yaml" if from_pbtxt else "pbtxt")
    # The name check is the loader's: a file converted on its own may sit in any directory.
    if from_pbtxt:
        config, warnings = parse_pbtxt_config(source, text, None)
    else:
        config, warnings = parse_model_config(source, text, None), ()
    if target == "pbtxt":
        return config_to_pbtxt(config), warnings
    fields: dict[str, Any] = config.model_dump(mode="json", exclude_unset=True)
    return yaml.safe_dump(fields, sort_keys=False), warnings
