"""From a model's repository entry to the worker launches of one version (spec, device, environment)."""

from __future__ import annotations

import os
from pathlib import Path

from mpsd.config.model_config import InputConfig, ModelConfig, TensorConfig
from mpsd.config.repository import ModelSource
from mpsd.config.shape_buckets import mask_follows
from mpsd.daemon.supervise.gpus import daemon_cuda_gpus
from mpsd.daemon.supervise.placement import InstancePlacement, plan_instances, worker_environment
from mpsd.daemon.supervise.worker.process import WorkerLaunch
from mpsd.ipc.dtypes import config_to_wire
from mpsd.ipc.protocol import BucketSpec, ModelSpec, StateSpec, TensorSpec, WarmupSample, WarmupTensor

# Variables meant for the daemon alone: a worker that inherited them could talk to systemd as if it were
# the service's main process.
DAEMON_ONLY_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID")


def _tensor_spec(t: TensorConfig) -> TensorSpec:
    return TensorSpec(t.name, t.wire_datatype, tuple(t.dims), isinstance(t, InputConfig) and t.optional)


def _control_specs(config: ModelConfig) -> tuple[TensorSpec, ...]:
    """A sequence model's control inputs, which the daemon fills: after the config's inputs, in the order of
    `control_input`, one element each."""
    sb = config.sequence_batching
    if sb is None:
        return ()
    return tuple(
        TensorSpec(ci.name, config_to_wire(ci.control[0].tensor_type), (1,)) for ci in sb.control_input
    )


def _bucket_specs(config: ModelConfig) -> tuple[tuple[BucketSpec, ...], int, tuple[TensorSpec, ...]]:
    """A bucketed model's buckets, the one its mask input follows (-1: none), and the mask input's spec:
    after the config's inputs, dims those of the followed input up to the bucketed dim."""
    sb = config.shape_buckets
    if sb is None:
        return (), -1, ()
    order = [t.name for t in config.input]
    specs = tuple(BucketSpec(order.index(name), b.dim, tuple(b.sizes)) for name, b in sb.inputs.items())
    follows = mask_follows(config)
    if sb.mask_input is None or follows is None:
        return specs, -1, ()
    which = list(sb.inputs).index(follows)
    bucket = specs[which]
    dims = config.input[bucket.input].dims[: bucket.dim + (0 if config.max_batch_size > 0 else 1)]
    mask = TensorSpec(sb.mask_input.name, config_to_wire(sb.mask_input.data_type), tuple(dims))
    return specs, which, (mask,)


def state_specs(config: ModelConfig, model_dir: Path) -> tuple[StateSpec, ...]:
    """A sequence model's implicit states, their initial data read from the model's folder."""
    sb = config.sequence_batching
    if sb is None:
        return ()
    specs = []
    for state in sb.state:
        initial = None
        for given in state.initial_state:
            if given.data_file is not None:
                initial = (model_dir / "initial_state" / given.data_file).read_bytes()
        specs.append(
            StateSpec(
                state.input_name,
                state.output_name,
                config_to_wire(state.data_type),
                tuple(state.dims),
                initial,
            )
        )
    return tuple(specs)


def _warmup_samples(config: ModelConfig) -> tuple[WarmupSample, ...]:
    """The configured warm-up requests with full shapes, inputs in the order the model takes them (a
    sequence model's controls as zeros)."""
    samples = []
    controls = _control_specs(config)
    buckets, follows, mask = _bucket_specs(config)
    for w in config.model_warmup:
        batch = (w.batch_size,) if config.max_batch_size > 0 else ()
        given = [(t, w.inputs[t.name]) for t in config.input if t.name in w.inputs]
        tensors = tuple(
            WarmupTensor(t.name, t.wire_datatype, batch + tuple(data.dims), data.random_data)
            for t, data in given
        ) + tuple(WarmupTensor(c.name, c.datatype, batch + c.dims) for c in controls)
        if mask:  # zeros, shaped as the followed input's sample up to its bucketed dim
            b = buckets[follows]
            tensors += (WarmupTensor(mask[0].name, mask[0].datatype, tensors[b.input].shape[: b.dim + 1]),)
        samples.append(WarmupSample(w.name, tensors, w.count))
    return tuple(samples)


def model_spec(source: ModelSource, version: int) -> ModelSpec:
    config = source.config
    assert config is not None
    buckets, follows, mask = _bucket_specs(config)
    return ModelSpec(
        name=source.name,
        version=version,
        backend=config.backend,
        model_path=str(source.path / str(version) / config.model_filename),
        max_batch_size=config.max_batch_size,
        inputs=tuple(_tensor_spec(t) for t in config.input) + _control_specs(config) + mask,
        outputs=tuple(_tensor_spec(t) for t in config.output),
        parameters=dict(config.parameters),
        allow_pickle=config.allow_pickle,
        warmup=_warmup_samples(config),
        cuda_graph_batch_sizes=config.cuda_graph_batch_sizes(),
        op_libraries=source.op_libraries.get(version, ()),
        autocast=config.optimization.autocast,
        decoupled=config.model_transaction_policy.decoupled,
        compile_mode=compiled.mode if (compiled := config.optimization.compile) is not None else None,
        compile_dynamic=compiled.dynamic if compiled is not None else None,
        compile_batch_sizes=config.compile_batch_sizes(),
        sequence=config.sequence_batching is not None,
        states=state_specs(config, source.path),
        dynamic_batching=config.dynamic_batching is not None,
        buckets=buckets,
        mask_follows=follows,
    )


def worker_base_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in DAEMON_ONLY_ENV}


def _accelerator(config: ModelConfig, placement: InstancePlacement) -> str | None:
    """Triton's mps accelerator applies to GPU groups that do not list CUDA GPUs (`gpus`)."""
    wanted = config.optimization.gpu_accelerator
    pinned = config.instance_group[placement.group].gpus is not None
    if wanted is None or pinned or placement.kind not in ("KIND_GPU", "KIND_AUTO"):
        return None
    return wanted


def plan_version(source: ModelSource, version: int) -> tuple[list[InstancePlacement], list[WorkerLaunch]]:
    """Placements (for the memory budget) and one launch per instance (spec, device, environment)."""
    config = source.config
    assert config is not None
    if config.backend == "ensemble":  # its steps' models run its requests, in their own workers
        return [], []
    spec = model_spec(source, version)
    base = worker_base_env()
    placements = plan_instances(config, cuda_gpus=daemon_cuda_gpus())
    launches = [
        WorkerLaunch(
            model=spec,
            instance=placement.index,
            kind=placement.kind,
            memory_fraction=placement.memory_fraction,
            env=worker_environment(placement, config, base),
            max_device_memory_bytes=config.max_device_memory_bytes,
            max_rss_bytes=config.max_rss_bytes,
            gpu=placement.gpu,
            accelerator=_accelerator(config, placement),
        )
        for placement in placements
    ]
    return placements, launches
