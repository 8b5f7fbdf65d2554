"""From a model's repository entry to the worker launches of one version (spec, device, environment)."""

from __future__ import annotations

import os

from mpsd.config.model_config import ModelConfig, TensorConfig
from mpsd.config.repository import ModelSource
from mpsd.ipc.protocol import ModelSpec, TensorSpec

from .placement import plan_instances, worker_environment
from .worker_process import WorkerLaunch


def _tensor_spec(t: TensorConfig) -> TensorSpec:
    return TensorSpec(t.name, t.wire_datatype, tuple(t.dims), t.optional)


def model_spec(source: ModelSource, version: int) -> ModelSpec:
    config = source.config
    assert config is not None
    return ModelSpec(
        name=source.name,
        version=version,
        backend=config.backend,
        model_path=str(source.path / str(version) / config.model_filename),
        max_batch_size=config.max_batch_size,
        inputs=tuple(_tensor_spec(t) for t in config.input),
        outputs=tuple(_tensor_spec(t) for t in config.output),
        parameters=dict(config.parameters),
        allow_pickle=config.allow_pickle,
    )


def version_launches(source: ModelSource, version: int) -> list[WorkerLaunch]:
    """One launch per instance of the version, each with its device placement and environment."""
    config: ModelConfig | None = source.config
    assert config is not None
    spec = model_spec(source, version)
    base = dict(os.environ)
    return [
        WorkerLaunch(
            model=spec,
            instance=placement.index,
            kind=placement.kind,
            memory_fraction=placement.memory_fraction,
            env=worker_environment(placement, config, base),
        )
        for placement in plan_instances(config)
    ]
