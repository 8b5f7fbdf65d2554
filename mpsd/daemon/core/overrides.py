"""Models loaded with what the load request brought instead of what the repository holds: Triton's `config`
load parameter (a JSON ModelConfig) and `file:<path>` parameters (the model's files).

An override lasts until the model is loaded again without one, unloaded, or its folder in the repository
changes (then the repository's config and files serve again, as a plain load would make them); the
repository's files are never written. Everything the request brought is checked before anything changes:
what cannot be loaded as given is refused as Triton refuses it, INTERNAL `failed to load 'm', failed to poll
from model repository`, followed by the reason (which Triton only logs) naming the parameter or the field.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from mpsd.config.daemon_config import DaemonConfig
from mpsd.config.repository import GivenConfig, ModelSource, load_model_source
from mpsd.daemon.core.rollout import ModelEntry
from mpsd.daemon.core.uploads import UploadStore
from mpsd.errors import InvalidArgument, LoadRefused, ModelConfigError

log = structlog.get_logger("mpsd.daemon.core.registry")

FILE_PREFIX = "file:"


@dataclass(frozen=True)
class LoadParameters:
    """What a load request brought, whatever the protocol: the `config` JSON and the `file:` contents."""

    config: str | None = None
    files: Mapping[str, bytes] = field(default_factory=dict)

    @property
    def given(self) -> bool:
        return self.config is not None or bool(self.files)


@dataclass(frozen=True)
class Override:
    source: ModelSource
    # The repository's model when the override was loaded (None: not in the repository): a change ends it.
    repository_fingerprint: str | None = None


def refused(model: str, detail: str) -> LoadRefused:
    """Triton's answer to a load it could not read ("failed to poll"), with the reason Triton only logs."""
    return LoadRefused(model, detail)


class Overrides:
    """The overrides in force, by model, and the folder their files are kept in."""

    def __init__(self, config: DaemonConfig, repository: Path, entries: Mapping[str, ModelEntry]) -> None:
        self.store = UploadStore(config.model_upload_dir, config.max_model_upload_bytes, repository)
        self.by_model: dict[str, Override] = {}
        self._entries = entries  # the registry's: what their sources refer to stays

    async def read(
        self,
        model: str,
        params: LoadParameters | None,
        allow_symlinks: bool = False,
        op_library_dirs: Sequence[Path] = (),
    ) -> tuple[ModelSource | None, Path | None]:
        """The source to load (None: the repository's), and the folder reserved for its files (to release
        once loaded or refused); LoadRefused before anything changes when the request cannot be loaded as
        given."""
        if params is None or not params.given:
            return None, None
        if params.config is None:
            raise refused(model, "Load parameter 'config' must be specified for model file override")
        # generated protobuf code (whose names clash with tritonclient's): only where a config comes
        from mpsd.config.json_config import parse_json_config

        # Without files, the repository's model: its config completes a partial override.
        base = None if params.files else load_model_source(self.store.repository / model).config
        try:
            config, warnings, written = parse_json_config(params.config, model, base)
        except ModelConfigError as exc:
            raise refused(model, f"Invalid config override: {exc.message}") from None
        if not params.files:
            fingerprint = hashlib.sha256(f"config override\n{params.config}".encode()).hexdigest()
            given = GivenConfig(config, warnings, fingerprint, written)
            source = load_model_source(self.store.repository / model, allow_symlinks, op_library_dirs, given)
            if source.error is not None:
                raise refused(model, source.error)
            return source, None
        try:
            self.store.check(params.files)
        except InvalidArgument as exc:
            raise refused(model, exc.message) from None
        holder = self.store.reserve()
        try:
            model_dir = await asyncio.to_thread(self.store.write, holder, model, params.files)
            fingerprint = hashlib.sha256(f"{params.config}\n{model_dir}".encode()).hexdigest()
            given = GivenConfig(config, warnings, fingerprint, written)
            return self._uploaded(model, model_dir, given, op_library_dirs), holder
        except InvalidArgument as exc:  # a file that cannot be written where its path says
            self.store.discard(holder)
            raise refused(model, exc.message) from None
        except BaseException:
            self.store.discard(holder)
            raise

    @staticmethod
    def _uploaded(
        model: str, model_dir: Path, given: GivenConfig, op_library_dirs: Sequence[Path]
    ) -> ModelSource:
        """The source of an uploaded model directory. Its fingerprints name the folder, so no version of
        another upload (whose files go once it is replaced) is ever kept or resized in its place."""
        source = load_model_source(model_dir, False, op_library_dirs, given)
        if source.error is not None:  # said with the parameters' paths, not the daemon's folder
            raise refused(model, source.error.replace(f"{model_dir}/", FILE_PREFIX))
        tagged = {v: f"{fp}:{model_dir}" for v, fp in source.version_fingerprints.items()}
        return dataclasses.replace(source, version_fingerprints=tagged)

    def choose(
        self, model: str, source: ModelSource | None, allow_symlinks: bool, op_library_dirs: Sequence[Path]
    ) -> None:
        """What the model's next load serves: `source` (an override) or, for None, the repository's."""
        if source is None:
            self.forget(model)
            return
        model_dir = self.store.repository / model  # the repository's model now: a change to it ends this
        found = load_model_source(model_dir, allow_symlinks, op_library_dirs) if model_dir.is_dir() else None
        self.by_model[model] = Override(source, found.fingerprint if found is not None else None)
        log.info(
            "loading model with the request's config"
            + (" and files" if self.store.owns(source.path) else ""),
            model=model,
        )

    def forget(self, model: str) -> None:
        self.by_model.pop(model, None)

    def apply(self, desired: dict[str, ModelSource]) -> dict[str, ModelSource]:
        """The repository's sources with the overrides in force in place of theirs; an override whose
        model changed in the repository since ends here."""
        for model, override in list(self.by_model.items()):
            repository = desired.get(model)
            now = repository.fingerprint if repository is not None else None
            if now != override.repository_fingerprint:
                del self.by_model[model]
                log.info("model changed in the repository: its config and files serve again", model=model)
                continue
            desired[model] = override.source
        return desired

    def sweep(self, released: Path | None = None) -> None:
        """Release a load's folder, and remove every uploaded folder neither an override nor a model's
        source refers to any more."""
        if released is not None:
            self.store.release(released)
        in_use = [o.source.path for o in self.by_model.values()]
        in_use += [e.source.path for e in self._entries.values() if e.source is not None]
        self.store.sweep(in_use)
