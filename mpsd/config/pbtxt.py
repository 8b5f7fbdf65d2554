"""Triton's `config.pbtxt` (protobuf text format) as mpsd's ModelConfig (and back: `pbtxt_write.py`).

A Triton repository should serve unchanged, so every field is accounted for: fields mpsd honours are mapped,
fields it can ignore without changing any answer come back as warnings naming them, and fields whose meaning
mpsd cannot honour (another scheduler, another framework, reshaping) fail the load naming the field.

This module imports the generated protobuf code, whose message names clash with tritonclient's in one
process; it is imported only where a config.pbtxt is read or written (the daemon, `mpsd convert-config`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NoReturn

from google.protobuf import text_format  # type: ignore[import-untyped]

from mpsd.config.buckets_pbtxt import FORMS as BUCKET_FORMS
from mpsd.config.buckets_pbtxt import read_bucket_parameter
from mpsd.config.model_config import ModelConfig, ResidencyConfig
from mpsd.config.model_file import check_config_name, config_problem, validate_model_config
from mpsd.config.sequence_pbtxt import read_sequence_batching
from mpsd.errors import Issue, ModelConfigError
from mpsd.proto import model_config_pb2 as mc

# Triton's platform and backend names that mean a model mpsd serves, and which of its backends that is.
# Triton has no AOTInductor backend: "aoti" (backend) and "torch_aoti" (platform) are mpsd's own names.
_PLATFORMS = {"pytorch_libtorch": "torchscript", "torch_export": "torch_export", "torch_aoti": "aoti"}
_BACKENDS = {"pytorch": "torchscript", "torch_export": "torch_export", "aoti": "aoti", "python": "python"}
COMPILE_FIELDS = ("mode", "dynamic")  # mpsd.compile.<field>: optimization.compile (no Triton field)
MPS_ACCELERATOR = "mps"
MPSD_PREFIX = "mpsd."
# Written by the ModelConfig RPC about the running workers (`mpsd.instance_group.N.<key>`); read back, they
# configure nothing, so a config fetched from the daemon converts back.
REPORTED_PARAMETERS = ("device", "mps_not_used")
RESIDENCY_FIELDS = tuple(ResidencyConfig.model_fields)  # mpsd.residency.<field>

# Options of Triton's PyTorch backend: they tune libtorch inside Triton and mean nothing to mpsd (except
# INTRA_OP_THREAD_COUNT, which mpsd reads: daemon.supervise.placement.THREADS_PARAMETERS).
_TRITON_PYTORCH_OPTIONS = frozenset(
    {
        "DISABLE_OPTIMIZED_EXECUTION",
        "INFERENCE_MODE",
        "DISABLE_CUDNN",
        "ENABLE_WEIGHT_SHARING",
        "ENABLE_CACHE_CLEANING",
        "ENABLE_JIT_EXECUTOR",
        "ENABLE_JIT_PROFILING",
        "ENABLE_NVFUSER",
        "ENABLE_TENSOR_FUSER",
        "INTER_OP_THREAD_COUNT",
    }
)

# Fields whose meaning mpsd cannot honour: serving the model without them would give different answers
# or a different protocol, so the load fails with the reason.
_FATAL = {
    "batch_input": "batch inputs (tensors built by the batcher) are not supported by mpsd",
    "batch_output": "batch outputs (tensors split by the batcher) are not supported by mpsd",
    "model_repository_agents": "repository agents (which rewrite model files) are not run by mpsd",
}
_TENSOR_FATAL = {
    "reshape": "mpsd passes tensors to the model in the shape the client sent",
    "is_shape_tensor": "shape tensors are not supported by mpsd",
    "allow_ragged_batch": "ragged batches are not supported by mpsd",
}


class _Reader:
    """Maps one parsed message field by field, collecting what is ignored."""

    def __init__(self) -> None:
        self.warnings: list[str] = []

    def ignore(self, path: str, why: str = "") -> None:
        self.warnings.append(f"{path} ({why})" if why else path)

    def read(self, msg: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        mps = False
        for field, value in _set_fields(msg):
            if field in _FATAL:
                _fail((field,), _FATAL[field])
            elif field in ("name", "default_model_filename", "max_batch_size"):
                out[field] = value
            elif field in ("platform", "backend"):
                continue  # decided together below
            elif field in ("input", "output"):
                out[field] = [self.tensor(field, i, t) for i, t in enumerate(value)]
            elif field == "version_policy":
                out[field] = _version_policy(value)
            elif field == "instance_group":
                out[field] = [self.instance_group(i, g) for i, g in enumerate(value)]
            elif field == "dynamic_batching":
                out[field] = self.dynamic_batching(value)
            elif field == "sequence_batching":
                out[field] = read_sequence_batching(value, self.warnings)
            elif field == "optimization":
                mps = self.optimization(value, out)
            elif field == "model_warmup":
                out[field] = [_warmup(i, w) for i, w in enumerate(value)]
            elif field == "model_operations":  # Triton's custom op libraries: mpsd's op_libraries
                out["op_libraries"] = list(value.op_library_filename)
            elif field == "model_transaction_policy":
                out[field] = {"decoupled": value.decoupled}
            elif field == "response_cache":
                out[field] = {"enable": value.enable}
            elif field == "ensemble_scheduling":
                out[field] = {"step": [self.step(i, step) for i, step in enumerate(value.step)]}
            elif field != "parameters":
                self.ignore(field)
        backend = _backend(msg.platform, msg.backend)
        if backend is not None:
            out["backend"] = backend
        if mps:  # Apple's GPU where MPS is usable; the worker falls back and says why where it is not
            out.setdefault("optimization", {})["gpu_accelerator"] = MPS_ACCELERATOR
        self.parameters(msg.parameters, out)
        return out

    def tensor(self, field: str, i: int, t: Any) -> dict[str, Any]:
        path = f"{field}.{i}"
        if t.data_type == mc.TYPE_INVALID:
            _fail((field, i, "data_type"), "required field is missing")
        out: dict[str, Any] = {
            "name": t.name,
            "data_type": mc.DataType.Name(t.data_type),
            "dims": list(t.dims),
        }
        for key, _ in _set_fields(t):
            if key in ("name", "data_type", "dims"):
                continue
            if key in _TENSOR_FATAL:
                _fail((field, i, key), _TENSOR_FATAL[key])
            if key == "optional":
                out["optional"] = True
            elif key == "format":
                out["format"] = mc.ModelInput.Format.Name(t.format)
            elif key == "label_filename":
                out["label_filename"] = t.label_filename
            else:
                self.ignore(f"{path}.{key}")
        return out

    def step(self, i: int, step: Any) -> dict[str, Any]:
        if step.model_namespace:
            self.ignore(f"ensemble_scheduling.step.{i}.model_namespace", "mpsd serves one namespace")
        return {
            "model_name": step.model_name,
            "model_version": step.model_version or -1,  # left out (0): the latest, as -1
            "input_map": dict(step.input_map),
            "output_map": dict(step.output_map),
        }

    def instance_group(self, i: int, g: Any) -> dict[str, Any]:
        path = f"instance_group.{i}"
        out: dict[str, Any] = {}
        for key, value in _set_fields(g):
            if key == "kind":
                kind = mc.ModelInstanceGroup.Kind.Name(value)
                if kind == "KIND_MODEL":
                    _fail(
                        ("instance_group", i, "kind"),
                        "KIND_MODEL (devices chosen by the model itself) is not supported",
                    )
                out["kind"] = kind
            elif key == "gpus":
                out["gpus"] = list(value)
            elif key in ("name", "count"):
                out[key] = value
            else:
                self.ignore(f"{path}.{key}")
        return out

    def dynamic_batching(self, db: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in _set_fields(db):
            if key == "preferred_batch_size":
                out[key] = list(value)
            elif key == "max_queue_delay_microseconds":
                out[key] = value
            elif key == "default_queue_policy":
                out[key] = _queue_policy(value)
            elif key == "priority_queue_policy":
                out[key] = {level: _queue_policy(policy) for level, policy in value.items()}
            elif key in ("priority_levels", "default_priority_level"):
                out[key] = value
            else:
                self.ignore(f"dynamic_batching.{key}")
        return out

    def optimization(self, opt: Any, out: dict[str, Any]) -> bool:
        """Whether MPS is requested; CUDA graphs go into `out`; every other setting is reported as ignored."""
        mps = False
        for key, value in _set_fields(opt):
            if key == "cuda":
                out["optimization"] = {"cuda": self.cuda(value)}
                continue
            if key != "execution_accelerators":
                self.ignore(f"optimization.{key}")
                continue
            for kind in ("gpu_execution_accelerator", "cpu_execution_accelerator"):
                for j, acc in enumerate(getattr(value, kind)):
                    path = f"optimization.execution_accelerators.{kind}.{j}"
                    if kind == "gpu_execution_accelerator" and acc.name == MPS_ACCELERATOR:
                        mps = True
                        if acc.parameters:
                            self.ignore(f"{path}.parameters")
                    else:
                        self.ignore(path, f"accelerator '{acc.name}' is not supported by mpsd")
        return mps

    def cuda(self, cuda: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in _set_fields(cuda):
            if key == "graphs":
                out["graphs"] = value
            elif key == "graph_spec" and not cuda.graphs:
                self.ignore("optimization.cuda.graph_spec", "graphs is false")
            elif key == "graph_spec":
                specs = []
                for i, spec in enumerate(value):
                    for skey, _ in _set_fields(spec):
                        if skey != "batch_size":  # mpsd records at the configured input dims
                            self.ignore(f"optimization.cuda.graph_spec.{i}.{skey}")
                    if spec.batch_size > 0:
                        specs.append({"batch_size": spec.batch_size})
                    else:
                        self.ignore(f"optimization.cuda.graph_spec.{i}", "no batch_size")
                out["graph_spec"] = specs
            else:
                self.ignore(f"optimization.cuda.{key}")
        return out

    def parameters(self, params: Any, out: dict[str, Any]) -> None:
        plain: dict[str, str] = {}
        for key in sorted(params):
            value = params[key].string_value
            if key.startswith(MPSD_PREFIX):
                _mpsd_parameter(key, value, out)
                continue
            plain[key] = value
            if key in _TRITON_PYTORCH_OPTIONS:
                self.ignore(f"parameters.{key}", "an option of Triton's PyTorch backend")
        if plain:
            out["parameters"] = plain


Loc = tuple[str | int, ...]


def _fail(loc: Loc, why: str) -> NoReturn:
    """Refuse the config; the file is not known here (parse_pbtxt_config adds it)."""
    raise config_problem(Issue("", loc, why))


def _queue_policy(policy: Any) -> dict[str, Any]:
    """A ModelQueuePolicy's fields as written, its timeout action by name."""
    out = dict(_set_fields(policy))
    if "timeout_action" in out:
        out["timeout_action"] = mc.ModelQueuePolicy.TimeoutAction.Name(out["timeout_action"])
    return out


def _set_fields(msg: Any) -> list[tuple[str, Any]]:
    return [(f.name, v) for f, v in msg.ListFields()]


def _backend(platform: str, backend: str) -> str | None:
    """mpsd's backend for Triton's platform/backend pair; anything but PyTorch fails naming the field."""
    if platform == "ensemble":
        if backend:
            _fail(("backend",), f"backend '{backend}' contradicts platform 'ensemble'")
        return "ensemble"
    chosen: set[str] = set()
    for field, value, known in (("platform", platform, _PLATFORMS), ("backend", backend, _BACKENDS)):
        if not value:
            continue
        if value not in known:
            _fail(
                (field,),
                f"'{value}' is not served by mpsd; it serves PyTorch and python models: "
                'platform "pytorch_libtorch", backend "pytorch" or backend "python"',
            )
        chosen.add(known[value])
    if len(chosen) > 1:
        _fail(("backend",), f"backend '{backend}' contradicts platform '{platform}'")
    return chosen.pop() if chosen else None


def _version_policy(policy: Any) -> dict[str, Any]:
    choice = policy.WhichOneof("policy_choice")
    if choice == "latest":
        return {"latest": {"num_versions": policy.latest.num_versions or 1}}
    if choice == "specific":
        return {"specific": {"versions": list(policy.specific.versions)}}
    if choice == "all":
        return {"all": {}}
    return {}


def _warmup(i: int, sample: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"name": sample.name}
    if sample.batch_size:
        out["batch_size"] = sample.batch_size
    if sample.count:
        out["count"] = sample.count
    inputs: dict[str, Any] = {}
    for name in sorted(sample.inputs):
        data = sample.inputs[name]
        loc: Loc = ("model_warmup", i, "inputs", name)
        choice = data.WhichOneof("input_data_type")
        if choice == "input_data_file":
            _fail((*loc, "input_data_file"), "data files are not supported; use zero_data or random_data")
        if choice is None:
            _fail(loc, "set zero_data or random_data")
        inputs[name] = {"data_type": mc.DataType.Name(data.data_type), "dims": list(data.dims)}
        inputs[name][choice] = getattr(data, choice)
    out["inputs"] = inputs
    return out


def _boolean(loc: Loc, value: str) -> bool:
    if value.lower() not in ("true", "false"):
        _fail(loc, f"'{value}' is not true or false")
    return value.lower() == "true"


def _mpsd_parameter(key: str, value: str, out: dict[str, Any]) -> None:
    """mpsd's own settings, which have no Triton field, travel as `mpsd.*` parameters."""
    name = key.removeprefix(MPSD_PREFIX)
    if name in ("allow_pickle", "max_device_memory_bytes", "max_rss_bytes"):
        out[name] = value
        return
    if name == "autocast":  # no Triton field: Triton's PyTorch backend has no mixed precision setting
        out.setdefault("optimization", {})["autocast"] = value
        return
    parts = name.split(".")
    if parts[0] == "shape_buckets" and read_bucket_parameter(name, value, out):
        return
    if len(parts) == 3 and parts[0] == "instance_group" and parts[2] in ("kind", "memory_fraction"):
        groups = out.setdefault("instance_group", [{}])
        if not parts[1].isdigit() or int(parts[1]) >= len(groups):
            _fail(("parameters", key), f"there is no instance_group {parts[1]}")
        groups[int(parts[1])][parts[2]] = value
        return
    if len(parts) == 2 and parts[0] == "compile" and parts[1] in COMPILE_FIELDS:
        compiled = out.setdefault("optimization", {}).setdefault("compile", {})
        compiled[parts[1]] = value if parts[1] == "mode" else _boolean(("parameters", key), value)
        return
    if len(parts) == 2 and parts[0] == "residency" and parts[1] in RESIDENCY_FIELDS:
        out.setdefault("residency", {})[parts[1]] = value
        return
    if len(parts) == 3 and parts[0] == "instance_group" and parts[2] in REPORTED_PARAMETERS:
        return  # what the ModelConfig RPC reports of the running workers: nothing to configure
    _fail(
        ("parameters", key),
        "unknown mpsd parameter (known: allow_pickle, autocast, max_device_memory_bytes, max_rss_bytes, "
        "instance_group.N.kind, instance_group.N.memory_fraction, "
        + ", ".join(f"compile.{f}" for f in COMPILE_FIELDS)
        + ", "
        + ", ".join(f"residency.{f}" for f in RESIDENCY_FIELDS)
        + f", {BUCKET_FORMS})",
    )


def pbtxt_to_dict(text: str) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The config.yaml fields equivalent to a config.pbtxt, and the ignored fields; the ModelConfigError (a
    ValueError) names the field that cannot be honoured."""
    try:
        msg = text_format.Parse(text, mc.ModelConfig())
    except text_format.ParseError as exc:
        raise config_problem(Issue("", (), f"invalid protobuf text: {exc}")) from None
    return message_to_dict(msg)


def message_to_dict(msg: Any) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The config.yaml fields equivalent to a parsed ModelConfig message (from a config.pbtxt or a load
    request's JSON), and the ignored fields."""
    reader = _Reader()
    return reader.read(msg), tuple(reader.warnings)


def parse_pbtxt_config(path: Path, text: str, dir_name: str | None) -> tuple[ModelConfig, tuple[str, ...]]:
    """Parse and validate a config.pbtxt; ModelConfigError (a ValueError) messages name the file and the
    field."""
    try:
        raw, warnings = pbtxt_to_dict(text)
    except ModelConfigError as exc:
        issues = [Issue(str(path), i.loc, i.problem) for i in exc.issues]
        raise ModelConfigError(f"{path}: {exc.message}", issues=issues) from None
    except ValueError as exc:  # anything else the protobuf reading refuses
        raise config_problem(Issue(str(path), (), str(exc))) from None
    config = validate_model_config(path, raw)
    check_config_name(path, config, dir_name)
    return config, warnings
