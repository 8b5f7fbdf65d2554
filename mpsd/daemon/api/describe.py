"""What a model is and how it runs, as Triton's protobuf messages: its metadata, its effective config and its
statistics. Both protocols answer with these (HTTP as their JSON mapping)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from google.protobuf import text_format  # type: ignore[import-untyped]
from google.protobuf.descriptor import FieldDescriptor

from mpsd.config.model_config import ModelConfig
from mpsd.config.pbtxt_write import (
    write_cuda_graphs,
    write_dynamic_batching,
    write_ensemble,
    write_libraries_and_autocast,
    write_tensor,
)
from mpsd.daemon.core.model_version import ModelVersion
from mpsd.daemon.dataplane.stats import Duration
from mpsd.proto import grpc_service_pb2 as pb
from mpsd.proto import model_config_pb2 as mc

# Triton has no MPS kind: MPS instances are GPU instances whose real kind is recorded in parameters.
_KIND = {
    "KIND_AUTO": mc.ModelInstanceGroup.KIND_AUTO,
    "KIND_GPU": mc.ModelInstanceGroup.KIND_GPU,
    "KIND_MPS": mc.ModelInstanceGroup.KIND_GPU,
    "KIND_CPU": mc.ModelInstanceGroup.KIND_CPU,
}


def group_devices(mv: ModelVersion) -> dict[int, list[Mapping[str, object]]]:
    """The devices the running workers of each instance group chose (their ready messages), by group."""
    group_of = {p.index: p.group for p in mv.placements}
    found: dict[int, list[Mapping[str, object]]] = {}
    for instance in mv.instances:
        worker = instance.worker
        if worker is not None and worker.ready is not None:
            found.setdefault(group_of.get(instance.launch.instance, 0), []).append(worker.ready.device)
    return found


# Triton's backend names where they differ from mpsd's (an ensemble has a platform and no backend).
_BACKEND_NAMES = {"torchscript": "pytorch", "ensemble": ""}


def effective_config(name: str, mv: ModelVersion) -> Any:
    """What ModelConfig answers, on either protocol: the config, with what its running workers chose."""
    msg = model_config_proto(name, mv.config, group_devices(mv))
    return as_written(msg, mv.pbtxt) if mv.pbtxt is not None else msg


def repeated(fd: Any) -> bool:
    """`is_repeated` where protobuf has it (5.29 on; 7 removed `label`), else the label."""
    flag = getattr(fd, "is_repeated", None)
    return bool(flag) if flag is not None else bool(fd.label == FieldDescriptor.LABEL_REPEATED)


def as_written(msg: Any, pbtxt: str) -> Any:
    """The config.pbtxt as written, with what mpsd serves in its place: fields mpsd does not act on (and
    reports as ignored) come back as written, so a client sees the Triton config it was given."""
    try:
        written = text_format.Parse(pbtxt, mc.ModelConfig())
    except text_format.ParseError:  # unreadable now: what is served is all there is
        return msg
    _clear_overlap(written, msg)
    written.MergeFrom(msg)
    return written


def _clear_overlap(written: Any, served: Any) -> None:
    """Empty the repeated fields of `written` that `served` sets (MergeFrom would append to them), down
    through the messages both set; maps are merged key by key, the served value winning."""
    for fd, value in served.ListFields():
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            continue
        if repeated(fd):
            written.ClearField(fd.name)
        elif fd.message_type is not None and written.HasField(fd.name):
            _clear_overlap(getattr(written, fd.name), value)


def model_config_proto(
    name: str, config: ModelConfig, devices: Mapping[int, Sequence[Mapping[str, object]]] | None = None
) -> Any:
    """The effective config in Triton's ModelConfig message; with `devices` (group_devices), the devices
    each group's workers run on, and why not MPS where Triton's mps accelerator asked for it."""
    msg = mc.ModelConfig(
        name=name,
        platform=config.platform,
        backend=_BACKEND_NAMES.get(config.backend, config.backend),
        max_batch_size=config.max_batch_size,
        default_model_filename=config.model_filename,
    )
    for src, dst in ((config.input, msg.input), (config.output, msg.output)):
        for t in src:
            write_tensor(t, dst.add())
    write_ensemble(config, msg)
    _write_instance_groups(name, config, msg, devices or {})
    _write_version_policy(config, msg)
    for key, value in config.parameters.items():
        msg.parameters[key].string_value = value
    if config.model_transaction_policy.decoupled:
        msg.model_transaction_policy.decoupled = True
    if config.response_cache.enable:
        msg.response_cache.enable = True
    if config.dynamic_batching is not None:
        write_dynamic_batching(config.dynamic_batching, msg.dynamic_batching)
    if config.optimization.cuda.graphs:  # the sizes in effect, defaults included
        write_cuda_graphs(msg, config.cuda_graph_batch_sizes())
    if config.optimization.gpu_accelerator is not None:
        msg.optimization.execution_accelerators.gpu_execution_accelerator.add(
            name=config.optimization.gpu_accelerator
        )
    write_libraries_and_autocast(config, msg)
    _write_warmup(config, msg)
    return msg


def _write_instance_groups(
    name: str, config: ModelConfig, msg: Any, devices: Mapping[int, Sequence[Mapping[str, object]]]
) -> None:
    """Each instance group, with mpsd's own facts about it (kind as written, memory fraction, devices) in
    `parameters`, which Triton's message has no field for. An ensemble has no workers, so no groups."""
    groups = config.instance_group if config.backend != "ensemble" else []
    for i, group in enumerate(groups):
        g = msg.instance_group.add(
            name=group.name or f"{name}_{i}", kind=_KIND[group.kind], count=group.count
        )
        if group.gpus:
            g.gpus.extend(group.gpus)
        msg.parameters[f"mpsd.instance_group.{i}.kind"].string_value = group.kind
        if group.memory_fraction is not None:
            msg.parameters[f"mpsd.instance_group.{i}.memory_fraction"].string_value = str(
                group.memory_fraction
            )
        wanted = config.optimization.gpu_accelerator == "mps" and group.gpus is None
        _group_devices(msg, i, wanted and group.kind in ("KIND_GPU", "KIND_AUTO"), devices.get(i, ()))


def _write_version_policy(config: ModelConfig, msg: Any) -> None:
    """The one policy set, or Triton's default (the latest version) when none is."""
    policy = config.version_policy
    if policy.all is not None:
        msg.version_policy.all.SetInParent()
    elif policy.specific is not None:
        msg.version_policy.specific.versions.extend(policy.specific.versions)
    else:
        msg.version_policy.latest.num_versions = policy.latest.num_versions if policy.latest else 1


def _write_warmup(config: ModelConfig, msg: Any) -> None:
    """Each warm-up sample; an input is random data or zeros (Triton's message names one or the other)."""
    for sample in config.model_warmup:
        w = msg.model_warmup.add(name=sample.name, batch_size=sample.batch_size, count=sample.count)
        for input_name, data in sample.inputs.items():
            w.inputs[input_name].data_type = mc.DataType.Value(data.data_type)
            w.inputs[input_name].dims.extend(data.dims)
            if data.random_data:
                w.inputs[input_name].random_data = True
            else:
                w.inputs[input_name].zero_data = True


def _group_devices(msg: Any, i: int, mps_wanted: bool, devices: Sequence[Mapping[str, object]]) -> None:
    """The devices a group's workers run on; with the mps accelerator (`mps_wanted`), why not MPS."""
    if not devices:
        return
    msg.parameters[f"mpsd.instance_group.{i}.device"].string_value = ",".join(
        sorted({str(d.get("kind")) for d in devices})
    )
    reasons = sorted({_skipped(d, "mps") for d in devices if d.get("kind") != "mps"} - {""})
    if mps_wanted and reasons:
        msg.parameters[f"mpsd.instance_group.{i}.mps_not_used"].string_value = "; ".join(reasons)


def _skipped(device: Mapping[str, object], kind: str) -> str:
    """Why a worker passed over a device kind, from its ready message ("" when it did not say)."""
    skipped = device.get("skipped")
    return str(skipped.get(kind, "")) if isinstance(skipped, dict) else ""


def _duration(target: Any, d: Duration) -> None:
    target.count = d.count
    target.ns = d.ns


def version_statistics(mv: ModelVersion) -> Any:
    s = mv.stats
    msg = pb.ModelStatistics(
        name=mv.name,
        version=str(mv.version),
        last_inference=s.last_inference_ms,
        inference_count=s.inference_count,
        execution_count=s.execution_count,
    )
    st = msg.inference_stats
    _duration(st.success, s.success)
    _duration(st.fail, s.fail)
    _duration(st.queue, s.queue)
    _duration(st.compute_input, s.compute_input)
    _duration(st.compute_infer, s.compute_infer)
    _duration(st.compute_output, s.compute_output)
    _duration(st.cache_hit, s.cache_hit)
    _duration(st.cache_miss, s.cache_miss)
    for usage in memory_usage(mv):
        msg.memory_usage.add(**usage)
    for size in sorted(s.batches):
        b = s.batches[size]
        bs = msg.batch_stats.add(batch_size=size)
        _duration(bs.compute_input, b.compute_input)
        _duration(bs.compute_infer, b.compute_infer)
        _duration(bs.compute_output, b.compute_output)
    return msg


# Which counter stands for "device memory in use" for each device kind.
_DEVICE_BYTES = ("allocated_bytes", "current_allocated_bytes")


def memory_usage(mv: ModelVersion) -> list[dict[str, Any]]:
    """Per instance: device memory in use (GPU) and process RSS (CPU), from the workers' latest snapshot."""
    usage: list[dict[str, Any]] = []
    for instance in mv.instances:
        worker = instance.worker
        if worker is None or not worker.memory:
            continue
        device = worker.ready.device if worker.ready is not None else {}
        for key in _DEVICE_BYTES:
            if key in worker.memory:
                index = device.get("index")
                usage.append(
                    {
                        "type": "GPU",
                        "id": index if isinstance(index, int) else 0,
                        "byte_size": worker.memory[key],
                    }
                )
        if "rss_bytes" in worker.memory:
            usage.append(
                {"type": "CPU", "id": instance.launch.instance, "byte_size": worker.memory["rss_bytes"]}
            )
    return usage


def tensor_metadata(config: ModelConfig, inputs: bool) -> list[Any]:
    batch = [-1] if config.max_batch_size > 0 else []
    tensors = config.input if inputs else config.output
    return [
        pb.ModelMetadataResponse.TensorMetadata(name=t.name, datatype=t.wire_datatype, shape=batch + t.dims)
        for t in tensors
    ]


def model_metadata(name: str, versions: list[str], config: ModelConfig) -> Any:
    """ModelMetadataResponse: the model's versions, platform, and tensors with their wire datatypes."""
    return pb.ModelMetadataResponse(
        name=name,
        versions=versions,
        platform=config.platform,
        inputs=tensor_metadata(config, inputs=True),
        outputs=tensor_metadata(config, inputs=False),
    )


def statistics(versions: list[ModelVersion]) -> Any:
    return pb.ModelStatisticsResponse(model_stats=[version_statistics(mv) for mv in versions])
