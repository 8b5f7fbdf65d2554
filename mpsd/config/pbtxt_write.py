"""mpsd's ModelConfig as Triton's `config.pbtxt`: the way back of `pbtxt.py`, for `mpsd convert-config` and
for the ModelConfig the daemon describes to clients (`api/describe.py`). mpsd-only settings become `mpsd.*`
parameters, which `pbtxt.py` reads back.

Like `pbtxt.py`, this imports the generated protobuf code: only where a config.pbtxt is written.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from google.protobuf import text_format  # type: ignore[import-untyped]

from mpsd.config.buckets_pbtxt import bucket_parameters
from mpsd.config.model_config import (
    DynamicBatching,
    InputConfig,
    InstanceGroup,
    ModelConfig,
    ModelWarmup,
    OutputConfig,
    QueuePolicy,
    TensorConfig,
    VersionPolicy,
)
from mpsd.config.pbtxt import MPS_ACCELERATOR, MPSD_PREFIX, RESIDENCY_FIELDS
from mpsd.config.sequence_pbtxt import write_sequence_batching
from mpsd.proto import model_config_pb2 as mc


def config_to_pbtxt(config: ModelConfig, name: str | None = None) -> str:
    """The config.pbtxt equivalent to a validated config; mpsd-only settings become `mpsd.*` parameters."""
    msg = mc.ModelConfig()
    if name is not None or config.name is not None:
        msg.name = name if name is not None else str(config.name)
    if config.backend == "torchscript":
        msg.platform, msg.backend = "pytorch_libtorch", "pytorch"
    elif config.backend == "ensemble":
        msg.platform = "ensemble"
        write_ensemble(config, msg)
    else:
        msg.backend = config.backend
    msg.max_batch_size = config.max_batch_size
    for src, dst in ((config.input, msg.input), (config.output, msg.output)):
        for t in src:
            write_tensor(t, dst.add())
    _write_version_policy(config.version_policy, msg)
    if config.model_transaction_policy.decoupled:
        msg.model_transaction_policy.decoupled = True
    if config.response_cache.enable:
        msg.response_cache.enable = True
    if config.instance_group != [InstanceGroup()]:
        _write_instance_groups(config.instance_group, msg)
    if config.default_model_filename:
        msg.default_model_filename = config.default_model_filename
    _write_parameters(config, msg)
    if config.dynamic_batching is not None:
        write_dynamic_batching(config.dynamic_batching, msg.dynamic_batching)
    if config.sequence_batching is not None:
        write_sequence_batching(config.sequence_batching, msg.sequence_batching)
    if config.optimization.cuda.graphs:
        write_cuda_graphs(msg, [g.batch_size for g in config.optimization.cuda.graph_spec])
    if config.optimization.gpu_accelerator == MPS_ACCELERATOR:
        msg.optimization.execution_accelerators.gpu_execution_accelerator.add(name=MPS_ACCELERATOR)
    write_libraries_and_autocast(config, msg)
    _write_warmup(config.model_warmup, msg)
    return str(text_format.MessageToString(msg))


def _write_parameters(config: ModelConfig, msg: Any) -> None:
    """The model's own parameters, and the mpsd-only settings as `mpsd.*` parameters (memory limits,
    pickle, residency, shape buckets)."""
    for key, value in config.parameters.items():
        msg.parameters[key].string_value = value
    for field in ("max_device_memory_bytes", "max_rss_bytes"):
        if getattr(config, field) is not None:
            msg.parameters[MPSD_PREFIX + field].string_value = str(getattr(config, field))
    if config.allow_pickle:
        msg.parameters[MPSD_PREFIX + "allow_pickle"].string_value = "true"
    for field in RESIDENCY_FIELDS:
        value = getattr(config.residency, field)
        if value is not None:
            text = str(value).lower() if isinstance(value, bool) else str(value)
            msg.parameters[f"{MPSD_PREFIX}residency.{field}"].string_value = text
    if config.shape_buckets is not None:
        for key, value in bucket_parameters(config.shape_buckets).items():
            msg.parameters[MPSD_PREFIX + key].string_value = value


def _write_warmup(samples: Sequence[ModelWarmup], msg: Any) -> None:
    for sample in samples:
        w = msg.model_warmup.add(name=sample.name, batch_size=sample.batch_size, count=sample.count)
        for input_name, data in sample.inputs.items():
            entry = w.inputs[input_name]
            entry.data_type = mc.DataType.Value(data.data_type)
            entry.dims.extend(data.dims)
            if data.random_data:
                entry.random_data = True
            else:
                entry.zero_data = True


def write_dynamic_batching(db: DynamicBatching, msg: Any) -> None:
    """The queue's fields of `db` into Triton's ModelDynamicBatching `msg` (delay, sizes, priority levels
    and queue policies); the short default-policy fields are written as Triton's default_queue_policy."""
    msg.max_queue_delay_microseconds = db.max_queue_delay_microseconds
    msg.preferred_batch_size.extend(db.preferred_batch_size)
    if db.default_policy != QueuePolicy():
        _write_queue_policy(db.default_policy, msg.default_queue_policy)
    if db.priority_levels:
        msg.priority_levels = db.priority_levels
        msg.default_priority_level = db.default_priority_level
        for level, policy in db.priority_queue_policy.items():
            _write_queue_policy(policy, msg.priority_queue_policy[level])


def _write_queue_policy(policy: QueuePolicy, msg: Any) -> None:
    msg.SetInParent()
    msg.timeout_action = mc.ModelQueuePolicy.TimeoutAction.Value(policy.timeout_action)
    msg.default_timeout_microseconds = policy.default_timeout_microseconds
    msg.allow_timeout_override = policy.allow_timeout_override
    msg.max_queue_size = policy.max_queue_size


def write_ensemble(config: ModelConfig, msg: Any) -> None:
    """An ensemble's steps into `ensemble_scheduling`."""
    if config.ensemble_scheduling is None:
        return
    for step in config.ensemble_scheduling.step:
        written = msg.ensemble_scheduling.step.add(
            model_name=step.model_name, model_version=step.model_version
        )
        written.input_map.update(step.input_map)
        written.output_map.update(step.output_map)


def write_tensor(t: TensorConfig, msg: Any) -> None:
    """One input or output into its ModelInput / ModelOutput message."""
    msg.name = t.name
    msg.data_type = mc.DataType.Value(t.data_type)
    msg.dims.extend(t.dims)
    if isinstance(t, InputConfig):
        msg.optional = t.optional
        if t.format != "FORMAT_NONE":
            msg.format = mc.ModelInput.Format.Value(t.format)
    if isinstance(t, OutputConfig) and t.label_filename is not None:
        msg.label_filename = t.label_filename


def write_libraries_and_autocast(config: ModelConfig, msg: Any) -> None:
    """Op libraries (Triton's `model_operations`), autocast and compile (`mpsd.*` parameters) in a
    ModelConfig."""
    if config.op_libraries:
        msg.model_operations.op_library_filename.extend(config.op_libraries)
    if config.optimization.autocast is not None:
        msg.parameters[MPSD_PREFIX + "autocast"].string_value = config.optimization.autocast
    compiled = config.optimization.compile
    if compiled is not None:
        msg.parameters[MPSD_PREFIX + "compile.mode"].string_value = compiled.mode
        if compiled.dynamic is not None:
            msg.parameters[MPSD_PREFIX + "compile.dynamic"].string_value = str(compiled.dynamic).lower()


def write_cuda_graphs(msg: Any, batch_sizes: Sequence[int]) -> None:
    """CUDA graphs on, at these batch sizes, in a ModelConfig message."""
    msg.optimization.cuda.graphs = True
    for size in batch_sizes:
        msg.optimization.cuda.graph_spec.add(batch_size=size)


def _write_version_policy(policy: VersionPolicy, msg: Any) -> None:
    if policy.all is not None:
        msg.version_policy.all.SetInParent()
    elif policy.specific is not None:
        msg.version_policy.specific.versions.extend(policy.specific.versions)
    elif policy.latest is not None:
        msg.version_policy.latest.num_versions = policy.latest.num_versions


def _write_instance_groups(groups: list[InstanceGroup], msg: Any) -> None:
    """KIND_MPS is Triton's KIND_GPU plus an `mpsd.*` parameter: the "mps" accelerator alone means a GPU
    that falls back (to CUDA, then the CPU) where MPS is not usable, and KIND_MPS never falls back."""
    for i, group in enumerate(groups):
        g = msg.instance_group.add(count=group.count)
        if group.name:
            g.name = group.name
        g.kind = mc.ModelInstanceGroup.Kind.Value("KIND_GPU" if group.kind == "KIND_MPS" else group.kind)
        if group.kind == "KIND_MPS":
            msg.parameters[f"{MPSD_PREFIX}instance_group.{i}.kind"].string_value = "KIND_MPS"
        if group.gpus:
            g.gpus.extend(group.gpus)
        if group.memory_fraction is not None:
            key = f"{MPSD_PREFIX}instance_group.{i}.memory_fraction"
            msg.parameters[key].string_value = str(group.memory_fraction)
