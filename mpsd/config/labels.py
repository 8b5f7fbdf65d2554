"""Classification labels (`label_filename` of an output): a text file in the model's folder, one label per
line, line i naming class index i (Triton's label files)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path

from mpsd.config.model_config import ModelConfig
from mpsd.errors import Issue

MAX_LABEL_FILE_BYTES = 64 * 1024 * 1024  # a label file is text the daemon holds in memory

Labels = Mapping[str, tuple[str, ...]]  # output name -> labels by class index


def read_labels(
    model_dir: Path, config: ModelConfig, config_file: Path
) -> tuple[dict[str, tuple[str, ...]], str]:
    """Each output's labels, and a digest of them that changes when a file does. Raises ValueError with an
    Issue (`LabelFileError`) naming the output's field when a file cannot be used."""
    labels: dict[str, tuple[str, ...]] = {}
    digest = hashlib.sha256()
    root = model_dir.resolve()
    for i, out in enumerate(config.output):
        if out.label_filename is None:
            continue
        name = out.label_filename

        def problem(why: str, i: int = i) -> LabelFileError:
            return LabelFileError(Issue(str(config_file), ("output", i, "label_filename"), why))

        try:
            resolved = (model_dir / name).resolve(strict=True)
            if not resolved.is_relative_to(root):
                raise problem(f"'{name}' is outside the model's folder")
            if resolved.stat().st_size > MAX_LABEL_FILE_BYTES:
                raise problem(f"'{name}' is larger than {MAX_LABEL_FILE_BYTES} bytes")
            text = resolved.read_bytes().decode("utf-8")
        except FileNotFoundError:
            raise problem(f"label file '{name}' does not exist in {model_dir}") from None
        except UnicodeDecodeError as exc:
            raise problem(f"'{name}' is not UTF-8 text (byte {exc.start})") from None
        except OSError as exc:
            raise problem(f"cannot read '{name}': {exc.strerror}") from None
        lines = text.split("\n")
        if lines and lines[-1] == "":  # the newline that ends the last line starts no label
            lines.pop()
        labels[out.name] = tuple(line.removesuffix("\r") for line in lines)
        digest.update(f"{out.name}\0{text}\0".encode())
    return labels, digest.hexdigest() if labels else ""


class LabelFileError(ValueError):
    """A label file that cannot be used; `issue` says which output's and why."""

    def __init__(self, issue: Issue) -> None:
        super().__init__(str(issue))
        self.issue = issue
