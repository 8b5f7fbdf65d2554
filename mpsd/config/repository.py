"""Reading a model repository: `<repo>/<model>/config.yaml` (or Triton's `config.pbtxt`) plus numeric
version directories.

Scanning never raises for a single broken model: the model is returned with the reason, so every other
model keeps serving.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mpsd.config.labels import LabelFileError, Labels, read_labels
from mpsd.config.model_config import ModelConfig
from mpsd.config.model_file import (
    parse_model_config,
)
from mpsd.config.op_libraries import libraries_fingerprint, resolve_op_libraries
from mpsd.errors import Issue, ModelConfigError

CONFIG_FILE = "config.yaml"
PBTXT_FILE = "config.pbtxt"  # Triton's format, read when there is no config.yaml
MODEL_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}$")
_TEMP_SUFFIXES = ("~", ".swp", ".swx", ".tmp", ".part", ".crdownload", ".partial")


def is_ignored_name(name: str) -> bool:
    """Dotfiles, editor backups and partial downloads are never part of a model."""
    return name.startswith(".") or name.endswith(_TEMP_SUFFIXES)


def model_name_problem(name: str) -> str | None:
    """Why `name` cannot be a model directory of the repository (path separators, `..`, NUL...), or None."""
    if not MODEL_NAME_RE.match(name):
        return (
            "a model name is 1 to 128 letters, digits, '_', '.' or '-', not starting with '.' or '-' "
            "(no path separators)"
        )
    if is_ignored_name(name):
        return f"names ending in {', '.join(_TEMP_SUFFIXES)} are temporary files, never models"
    return None


def escape_problem(path: Path, root: Path, what: str) -> Issue | None:
    """Why `path` may not be used: it resolves (through symlinks) to outside `root`. None when inside."""
    try:
        target = path.resolve(strict=True)
    except (OSError, RuntimeError) as exc:  # missing, a symlink loop
        return Issue(str(path), (), f"cannot resolve {what}: {exc}")
    if target.is_relative_to(root.resolve()):
        return None
    return Issue(
        str(path),
        (),
        f"{what} is a symlink to {target}, outside the model repository; "
        "set allow_symlinks: true in the daemon config to allow it",
    )


@dataclass(frozen=True)
class ModelSource:
    """What the repository says about one model directory right now."""

    name: str
    path: Path
    config: ModelConfig | None = None
    versions: tuple[int, ...] = ()
    error: str | None = None
    version_fingerprints: dict[int, str] = field(default_factory=dict)
    config_fingerprint: str = ""
    warnings: tuple[str, ...] = ()  # config fields that are ignored, each named with the reason
    issues: tuple[Issue, ...] = ()  # `error` as data: file, field and problem of each part
    op_libraries: dict[int, tuple[str, ...]] = field(default_factory=dict)  # per version, resolved paths
    labels: Labels = field(default_factory=dict)  # classification labels per output (label_filename)
    pbtxt: str | None = None  # the config.pbtxt as written, when the config is one (ModelConfig reports it)

    @property
    def ok(self) -> bool:
        return self.error is None and self.config is not None

    @property
    def fingerprint(self) -> str:
        """Changes whenever anything that decides how this model loads changes (or its error does)."""
        parts = [self.config_fingerprint, self.error or ""]
        parts += [f"{v}:{fp}" for v, fp in sorted(self.version_fingerprints.items())]
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def config_path(model_dir: Path) -> tuple[Path, Issue | None]:
    """The model's config file: config.yaml, else config.pbtxt; both present is an error (which wins
    would be a guess)."""
    yaml_path, pbtxt_path = model_dir / CONFIG_FILE, model_dir / PBTXT_FILE
    if not pbtxt_path.exists():
        return yaml_path, None
    if yaml_path.exists():
        return yaml_path, Issue(
            str(model_dir),
            (),
            f"both {CONFIG_FILE} and {PBTXT_FILE} are present; keep one "
            "(`mpsd convert-config` converts between them)",
        )
    return pbtxt_path, None


def _parse_config_file(path: Path, text: str, dir_name: str) -> tuple[ModelConfig, tuple[str, ...]]:
    if path.name != PBTXT_FILE:
        return parse_model_config(path, text, dir_name), ()
    from mpsd.config.pbtxt import parse_pbtxt_config  # generated protobuf code: only when a pbtxt exists

    return parse_pbtxt_config(path, text, dir_name)


def _is_version_name(name: str) -> bool:
    """`1`, `2`, `10`: a positive integer in canonical ASCII digits (not `0`, `01` or other scripts'
    digits); Triton ignores a version folder whose name starts with 0 too."""
    return name.isascii() and name.isdigit() and str(int(name)) == name and name != "0"


def _fingerprint_dir(directory: Path) -> str:
    """Changes whenever a file in the version directory is added, removed, resized or rewritten."""
    digest = hashlib.sha256()
    for p in sorted(directory.rglob("*")):
        rel = p.relative_to(directory)
        if any(is_ignored_name(part) for part in rel.parts) or "__pycache__" in rel.parts:
            continue
        try:
            if not p.is_file():
                continue
            st = p.stat()
        except OSError:  # removed while scanning: the next scan sees the directory as it ends up
            continue
        digest.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def _broken(name: str, model_dir: Path, issue: Issue, config_fingerprint: str = "") -> ModelSource:
    return ModelSource(
        name, model_dir, error=str(issue), issues=(issue,), config_fingerprint=config_fingerprint
    )


@dataclass(frozen=True)
class GivenConfig:
    """A config that comes with a load request instead of from the model directory's file: already
    parsed and validated, with the fingerprint that tells it from other configs."""

    config: ModelConfig
    warnings: tuple[str, ...]
    fingerprint: str
    pbtxt: str | None = None  # the config as written, in Triton's text format (ModelConfig reports it)


def _read_config(model_dir: Path, allow_symlinks: bool) -> tuple[Path, GivenConfig] | ModelSource:
    """The model directory's config file, parsed, or the broken source that says why not."""
    name, root = model_dir.name, model_dir.parent
    cfg_path, conflict = config_path(model_dir)
    if conflict is not None:
        return _broken(name, model_dir, conflict)
    if not allow_symlinks and cfg_path.exists():
        escape = escape_problem(cfg_path, root, cfg_path.name)
        if escape is not None:
            return _broken(name, model_dir, escape)
    try:
        text = cfg_path.read_text()
    except FileNotFoundError:
        return _broken(name, model_dir, Issue(str(cfg_path), (), "file is missing"))
    except OSError as exc:
        return _broken(name, model_dir, Issue(str(cfg_path), (), f"cannot read: {exc.strerror}"))
    except UnicodeDecodeError as exc:
        return _broken(name, model_dir, Issue(str(cfg_path), (), f"not UTF-8 text (byte {exc.start})"))
    cfg_fp = hashlib.sha256(text.encode()).hexdigest()
    try:
        config, warnings = _parse_config_file(cfg_path, text, name)
    except ValueError as exc:
        issues = exc.issues if isinstance(exc, ModelConfigError) else (Issue(str(cfg_path), (), str(exc)),)
        return ModelSource(name, model_dir, error=str(exc), issues=issues, config_fingerprint=cfg_fp)
    return cfg_path, GivenConfig(config, warnings, cfg_fp, text if cfg_path.name == PBTXT_FILE else None)


def load_model_source(
    model_dir: Path,
    allow_symlinks: bool = False,
    op_library_dirs: Sequence[Path] = (),
    given: GivenConfig | None = None,
) -> ModelSource:
    """Read one model directory; problems come back in `error` (and `issues`), never as exceptions.

    Unless `allow_symlinks`, the model directory, its config, version directories and model files must
    all resolve to inside the repository (the directory holding `model_dir`). Op libraries must resolve to
    inside the model directory or one of `op_library_dirs`, whatever `allow_symlinks` says. A `given`
    config is used in place of the directory's config file, which is then not read.
    """
    name = model_dir.name
    if not MODEL_NAME_RE.match(name):
        return _broken(name, model_dir, Issue(str(model_dir), (), f"invalid model name '{name}'"))
    root = model_dir.parent
    if not allow_symlinks:
        escape = escape_problem(model_dir, root, "the model directory")
        if escape is not None:
            return _broken(name, model_dir, escape)
    if given is not None:
        cfg_path = Path("config")  # where a problem of the config is said to be: the request's parameter
    else:
        read = _read_config(model_dir, allow_symlinks)
        if isinstance(read, ModelSource):
            return read
        cfg_path, given = read
    config, warnings, cfg_fp = given.config, given.warnings, given.fingerprint

    versions = _select_versions(model_dir, config)
    if isinstance(versions, Issue):
        return _broken(name, model_dir, versions, cfg_fp)
    bad_filename = _model_filename_problem(config, cfg_path)
    if bad_filename is not None:
        return _broken(name, model_dir, bad_filename, cfg_fp)
    try:
        labels, labels_fp = read_labels(model_dir, config, cfg_path)
    except LabelFileError as exc:
        return _broken(name, model_dir, exc.issue, cfg_fp)
    found = _version_files(model_dir, config, versions, cfg_path, allow_symlinks, op_library_dirs, labels_fp)
    if isinstance(found, Issue):
        return _broken(name, model_dir, found, cfg_fp)
    fingerprints, libraries = found
    return ModelSource(
        name,
        model_dir,
        config=config,
        versions=tuple(versions),
        version_fingerprints=fingerprints,
        config_fingerprint=cfg_fp,
        warnings=warnings,
        op_libraries=libraries,
        labels=labels,
        pbtxt=given.pbtxt,
    )


def _select_versions(model_dir: Path, config: ModelConfig) -> list[int] | Issue:
    """The version directories present that the version policy selects; why none, when none."""
    try:
        available = [int(p.name) for p in model_dir.iterdir() if p.is_dir() and _is_version_name(p.name)]
    except OSError as exc:
        return Issue(str(model_dir), (), f"cannot list: {exc.strerror}")
    versions = config.version_policy.select(available)
    if not versions:
        problem = f"no version directory matches the version policy (found {sorted(available) or 'none'})"
        return Issue(str(model_dir), (), problem)
    return versions


def _model_filename_problem(config: ModelConfig, cfg_path: Path) -> Issue | None:
    """The model file's name must stay inside its version directory (an ensemble has no file of its own)."""
    filename = config.model_filename
    if config.backend != "ensemble" and (
        filename in ("", ".", "..") or "/" in filename or "\\" in filename or "\0" in filename
    ):
        problem = f"'{filename}' must be a plain file name inside the version directory"
        return Issue(str(cfg_path), ("default_model_filename",), problem)
    return None


def _version_files(
    model_dir: Path,
    config: ModelConfig,
    versions: list[int],
    cfg_path: Path,
    allow_symlinks: bool,
    op_library_dirs: Sequence[Path],
    labels_fp: str,
) -> tuple[dict[int, str], dict[int, tuple[str, ...]]] | Issue:
    """Each selected version's fingerprint and op libraries, or the first problem of its files.

    A version's fingerprint covers its directory, its op libraries and the labels: a change to any of them
    is a new version (a running one is not changed in place)."""
    root = model_dir.parent
    ensemble = config.backend == "ensemble"  # no file of its own: only its version folders
    fingerprints: dict[int, str] = {}
    libraries: dict[int, tuple[str, ...]] = {}
    for v in versions:
        model_file = model_dir / str(v) / config.model_filename
        if not allow_symlinks and model_file.exists():
            escape = escape_problem(model_dir / str(v), root, f"version directory {v}") or escape_problem(
                model_file, root, "the model file"
            )
            if escape is not None:
                return escape
        if not ensemble and not model_file.is_file():
            return Issue(str(model_file), (), "model file is missing")
        libraries[v], refused = resolve_op_libraries(
            model_dir, v, config.op_libraries, op_library_dirs, cfg_path
        )
        if refused is not None:
            return refused
        fingerprints[v] = _fingerprint_dir(model_dir / str(v))
        if libraries[v]:
            fingerprints[v] += ":" + libraries_fingerprint(libraries[v])
        if labels_fp:
            fingerprints[v] += ":labels:" + labels_fp
    return fingerprints, libraries


def scan_repository(
    repo: Path, allow_symlinks: bool = False, op_library_dirs: Sequence[Path] = ()
) -> dict[str, ModelSource]:
    """Every model directory in the repository, broken ones included (with their reason)."""
    models: dict[str, ModelSource] = {}
    for entry in sorted(repo.iterdir()):
        if entry.is_dir() and not is_ignored_name(entry.name):
            models[entry.name] = load_model_source(entry, allow_symlinks, op_library_dirs)
    return models
