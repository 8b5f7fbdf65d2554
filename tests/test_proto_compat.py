"""mpsd's .proto files must stay wire-compatible with Triton's, field for field.

Our messages share their full names with tritonclient's (package ``inference``),
so this module never imports ``mpsd.proto.*_pb2``: the default descriptor pool
rejects duplicate symbols. Instead our files are compiled with grpc_tools into a
descriptor set and loaded into a private pool, then compared with the
descriptors tritonclient ships.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, text_format
from google.protobuf.descriptor import Descriptor, EnumDescriptor, FileDescriptor
from google.protobuf.descriptor_pb2 import FieldDescriptorProto as FDP
from google.protobuf.message import Message
from grpc_tools import protoc
from tritonclient.grpc import model_config_pb2 as triton_model_config
from tritonclient.grpc import service_pb2 as triton_service

REPO = Path(__file__).resolve().parents[1]
PROTO_ROOT = REPO / "proto"
PROTO_FILES = sorted(PROTO_ROOT.glob("mpsd/proto/*.proto"))
GENERATED_DIR = REPO / "mpsd" / "proto"
SERVICE_FILE = "mpsd/proto/grpc_service.proto"
CONFIG_FILE = "mpsd/proto/model_config.proto"


# ModelConfig fields mpsd relies on when reading a Triton config.pbtxt.
REQUIRED_MODEL_CONFIG_FIELDS = (
    "name",
    "platform",
    "backend",
    "version_policy",
    "max_batch_size",
    "input",
    "output",
    "instance_group",
    "default_model_filename",
    "parameters",
    "dynamic_batching",
    "sequence_batching",
    "ensemble_scheduling",
    "optimization",
    "model_warmup",
    "model_transaction_policy",
)

# A config.pbtxt in Triton's style touching most of the fields above.
SAMPLE_CONFIG_PBTXT = """
name: "resnet"
platform: "pytorch_libtorch"
backend: "pytorch"
max_batch_size: 8
version_policy { specific { versions: [1, 3] } }
input [
  { name: "INPUT__0" data_type: TYPE_FP32 format: FORMAT_NCHW dims: [3, -1, -1]
    reshape { shape: [1, 3, -1, -1] } optional: true }
]
output [ { name: "OUTPUT__0" data_type: TYPE_FP16 dims: [1000] label_filename: "labels.txt" } ]
instance_group [
  { name: "gpu" kind: KIND_GPU count: 2 gpus: [0, 1]
    rate_limiter { resources [ { name: "R" count: 2 } ] priority: 1 } },
  { kind: KIND_CPU count: 1 }
]
default_model_filename: "model.pt"
parameters { key: "INFERENCE_MODE" value { string_value: "true" } }
dynamic_batching {
  preferred_batch_size: [4, 8]
  max_queue_delay_microseconds: 100
  default_queue_policy { timeout_action: DELAY max_queue_size: 16 }
  priority_levels: 2
  priority_queue_policy { key: 1 value { default_timeout_microseconds: 5000 } }
}
optimization {
  priority: PRIORITY_MAX
  execution_accelerators {
    gpu_execution_accelerator [ { name: "tensorrt" parameters { key: "precision_mode" value: "FP16" } } ]
  }
  input_pinned_memory { enable: false }
}
model_warmup [
  { name: "zeros" batch_size: 2 count: 3
    inputs { key: "INPUT__0" value { data_type: TYPE_FP32 dims: [3, 224, 224] zero_data: true } } },
  { name: "file" batch_size: 1
    inputs { key: "INPUT__0" value { data_type: TYPE_FP32 dims: [3, 8, 8] input_data_file: "raw" } } }
]
model_transaction_policy { decoupled: false }
"""


def compile_descriptor_set(out_dir: Path) -> descriptor_pb2.FileDescriptorSet:
    """Compile our protos the way `make proto` sees them (-I proto), imports included."""
    out = out_dir / "mpsd_protos.pb"
    rc = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"--descriptor_set_out={out}",
            "--include_imports",
            *map(str, PROTO_FILES),
        ]
    )
    assert rc == 0, f"protoc failed ({rc}) compiling {[p.name for p in PROTO_FILES]}"
    return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def load_pool(fds: descriptor_pb2.FileDescriptorSet) -> descriptor_pool.DescriptorPool:
    """A private pool, so our `inference.*` names never meet tritonclient's."""
    pool = descriptor_pool.DescriptorPool()
    for file_proto in fds.file:  # --include_imports lists dependencies first
        pool.Add(file_proto)
    return pool


def _as_proto(desc: Descriptor) -> descriptor_pb2.DescriptorProto:
    proto = descriptor_pb2.DescriptorProto()
    desc.CopyToProto(proto)
    return proto


def _field_signature(msg: descriptor_pb2.DescriptorProto, field: FDP) -> dict[str, object]:
    """Everything about a field that decides its wire and text encoding."""
    return {
        "number": field.number,
        "type": FDP.Type.Name(field.type),
        "label": FDP.Label.Name(field.label),
        "type_name": field.type_name,
        "oneof": msg.oneof_decl[field.oneof_index].name if field.HasField("oneof_index") else None,
        "proto3_optional": field.proto3_optional,
    }


def compare_enum(ours: EnumDescriptor, theirs: EnumDescriptor | None) -> list[str]:
    """Enums are kept whole: same value names with the same numbers, both ways."""
    if theirs is None:
        return [f"enum {ours.full_name}: not defined by Triton"]
    mine = {v.name: v.number for v in ours.values}
    other = {v.name: v.number for v in theirs.values}
    problems = [
        f"enum {ours.full_name}.{name}: number {num}, Triton has {other[name]}"
        for name, num in mine.items()
        if name in other and other[name] != num
    ]
    problems += [
        f"enum {ours.full_name}.{n}: not defined by Triton" for n in sorted(mine.keys() - other.keys())
    ]
    problems += [
        f"enum {ours.full_name}.{n}: missing (Triton defines it)" for n in sorted(other.keys() - mine.keys())
    ]
    return problems


def compare_message(ours: Descriptor, theirs: Descriptor | None, complete: bool) -> list[str]:
    """Every field, nested message and enum of ours must match Triton's exactly.

    With `complete`, every field and nested type of theirs must also exist in ours.
    """
    if theirs is None:
        return [f"message {ours.full_name}: not defined by Triton"]
    problems: list[str] = []
    mine_p, theirs_p = _as_proto(ours), _as_proto(theirs)
    if mine_p.options.map_entry != theirs_p.options.map_entry:
        problems.append(f"message {ours.full_name}: map_entry differs from Triton")
    their_fields = {f.name: f for f in theirs_p.field}
    for field in mine_p.field:
        where = f"{ours.full_name}.{field.name}"
        if field.name not in their_fields:
            problems.append(f"field {where}: not defined by Triton")
            continue
        mine_sig = _field_signature(mine_p, field)
        their_sig = _field_signature(theirs_p, their_fields[field.name])
        problems += [
            f"field {where}: {key} is {mine_sig[key]!r}, Triton has {their_sig[key]!r}"
            for key in mine_sig
            if mine_sig[key] != their_sig[key]
        ]
    for nested in ours.nested_types:
        problems += compare_message(nested, theirs.nested_types_by_name.get(nested.name), complete)
    for enum in ours.enum_types:
        problems += compare_enum(enum, theirs.enum_types_by_name.get(enum.name))
    if complete:
        have = {f.name for f in mine_p.field} | {n.name for n in ours.nested_types}
        have |= {e.name for e in ours.enum_types}
        wanted = {f.name for f in theirs_p.field} | {n.name for n in theirs.nested_types}
        wanted |= {e.name for e in theirs.enum_types}
        problems += [f"{ours.full_name}.{n}: missing (Triton defines it)" for n in sorted(wanted - have)]
    return problems


def compare_file(ours: FileDescriptor, theirs: FileDescriptor, complete: bool) -> list[str]:
    """Compare all messages, enums and services of one of our files with Triton's file."""
    problems: list[str] = []
    if ours.package != theirs.package:
        problems.append(f"file {ours.name}: package {ours.package!r}, Triton has {theirs.package!r}")
    for msg in ours.message_types_by_name.values():
        problems += compare_message(msg, theirs.message_types_by_name.get(msg.name), complete)
    for enum in ours.enum_types_by_name.values():
        problems += compare_enum(enum, theirs.enum_types_by_name.get(enum.name))
    if complete:
        missing = (set(theirs.message_types_by_name) - set(ours.message_types_by_name)) | (
            set(theirs.enum_types_by_name) - set(ours.enum_types_by_name)
        )
        problems += [f"{theirs.package}.{n}: missing (Triton defines it)" for n in sorted(missing)]
    for service in ours.services_by_name.values():
        their_service = theirs.services_by_name.get(service.name)
        if their_service is None:
            problems.append(f"service {service.full_name}: not defined by Triton")
            continue
        for method in service.methods:
            where = f"rpc {service.full_name}.{method.name}"
            other = their_service.methods_by_name.get(method.name)
            if other is None:
                problems.append(f"{where}: not defined by Triton")
                continue
            mine_sig = (
                method.input_type.full_name,
                method.output_type.full_name,
                method.client_streaming,
                method.server_streaming,
            )
            their_sig = (
                other.input_type.full_name,
                other.output_type.full_name,
                other.client_streaming,
                other.server_streaming,
            )
            if mine_sig != their_sig:
                problems.append(
                    f"{where}: (input, output, client/server streaming) {mine_sig}, Triton {their_sig}"
                )
        problems += [
            f"rpc {service.full_name}.{name}: missing (Triton defines it)"
            for name in sorted(set(their_service.methods_by_name) - set(service.methods_by_name))
        ]
    for name in sorted(set(theirs.services_by_name) - set(ours.services_by_name)):
        problems.append(f"service {theirs.package}.{name}: missing (Triton defines it)")
    return problems


def compare_all(pool: descriptor_pool.DescriptorPool) -> list[str]:
    """The service file must be complete; model_config may be a subset of Triton's."""
    return compare_file(
        pool.FindFileByName(SERVICE_FILE), triton_service.DESCRIPTOR, complete=True
    ) + compare_file(pool.FindFileByName(CONFIG_FILE), triton_model_config.DESCRIPTOR, complete=False)


@pytest.fixture(scope="module")
def descriptor_set(tmp_path_factory: pytest.TempPathFactory) -> descriptor_pb2.FileDescriptorSet:
    return compile_descriptor_set(tmp_path_factory.mktemp("proto"))


@pytest.fixture(scope="module")
def pool(descriptor_set: descriptor_pb2.FileDescriptorSet) -> descriptor_pool.DescriptorPool:
    return load_pool(descriptor_set)


def test_proto_files_present() -> None:
    names = {p.relative_to(PROTO_ROOT).as_posix() for p in PROTO_FILES}
    assert {SERVICE_FILE, CONFIG_FILE} <= names


def test_matches_triton(pool: descriptor_pool.DescriptorPool) -> None:
    problems = compare_all(pool)
    assert not problems, "incompatible with Triton:\n" + "\n".join(problems)


def test_model_config_has_fields_mpsd_reads(pool: descriptor_pool.DescriptorPool) -> None:
    config = pool.FindMessageTypeByName("inference.ModelConfig")
    missing = [f for f in REQUIRED_MODEL_CONFIG_FIELDS if f not in config.fields_by_name]
    assert not missing, f"inference.ModelConfig lacks {missing}"
    oneof = config.oneofs_by_name["scheduling_choice"]
    assert {f.name for f in oneof.fields} == {"dynamic_batching", "sequence_batching", "ensemble_scheduling"}


def _message_class(pool: descriptor_pool.DescriptorPool, full_name: str) -> type[Message]:
    """A message class built from our private pool (the default pool holds tritonclient's)."""
    cls: type[Message] = message_factory.GetMessageClass(pool.FindMessageTypeByName(full_name))
    return cls


def test_config_pbtxt_round_trips_through_triton(pool: descriptor_pool.DescriptorPool) -> None:
    """A Triton config.pbtxt parses into ours and encodes to the very bytes Triton's does."""
    ours = text_format.Parse(SAMPLE_CONFIG_PBTXT, _message_class(pool, "inference.ModelConfig")())
    theirs = text_format.Parse(SAMPLE_CONFIG_PBTXT, triton_model_config.ModelConfig())
    assert ours.SerializeToString(deterministic=True) == theirs.SerializeToString(deterministic=True)
    assert triton_model_config.ModelConfig.FromString(ours.SerializeToString()) == theirs


def test_infer_request_from_tritonclient_decodes(pool: descriptor_pool.DescriptorPool) -> None:
    """Bytes a tritonclient request puts on the wire decode into our message unchanged."""
    request = triton_service.ModelInferRequest(model_name="m", model_version="1", id="7")
    request.parameters["sequence_id"].int64_param = 42
    tensor = request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 2])
    tensor.parameters["shared_memory_region"].string_param = "r0"
    request.outputs.add(name="OUTPUT0").parameters["classification"].int64_param = 3
    request.raw_input_contents.append(b"\x00" * 8)
    ours = _message_class(pool, "inference.ModelInferRequest").FromString(request.SerializeToString())
    assert ours.inputs[0].parameters["shared_memory_region"].string_param == "r0"
    assert ours.parameters["sequence_id"].WhichOneof("parameter_choice") == "int64_param"
    assert ours.SerializeToString(deterministic=True) == request.SerializeToString(deterministic=True)


def _find_message(fds: descriptor_pb2.FileDescriptorSet, dotted: str) -> descriptor_pb2.DescriptorProto:
    """Locate e.g. 'ModelInferRequest.InferInputTensor' in a descriptor set."""
    head, *rest = dotted.split(".")
    msg = next(m for f in fds.file for m in f.message_type if m.name == head)
    for part in rest:
        msg = next(n for n in msg.nested_type if n.name == part)
    return msg


def _field(fds: descriptor_pb2.FileDescriptorSet, dotted: str) -> FDP:
    msg_name, _, field_name = dotted.rpartition(".")
    return next(f for f in _find_message(fds, msg_name).field if f.name == field_name)


def _renumber(fds: descriptor_pb2.FileDescriptorSet) -> None:
    _field(fds, "ModelInferRequest.InferInputTensor.shape").number = 13


def _retype(fds: descriptor_pb2.FileDescriptorSet) -> None:
    _field(fds, "ModelConfig.max_batch_size").type = FDP.TYPE_UINT32


def _relabel(fds: descriptor_pb2.FileDescriptorSet) -> None:
    _field(fds, "ModelInferRequest.raw_input_contents").label = FDP.LABEL_OPTIONAL


def _retarget(fds: descriptor_pb2.FileDescriptorSet) -> None:
    _field(fds, "ModelStreamInferResponse.infer_response").type_name = ".inference.ModelInferRequest"


def _out_of_oneof(fds: descriptor_pb2.FileDescriptorSet) -> None:
    _field(fds, "InferParameter.uint64_param").ClearField("oneof_index")


def _enum_value(fds: descriptor_pb2.FileDescriptorSet) -> None:
    config = next(f for f in fds.file if f.name == CONFIG_FILE)
    data_type = next(e for e in config.enum_type if e.name == "DataType")
    next(v for v in data_type.value if v.name == "TYPE_BF16").number = 15


def _drop_field(fds: descriptor_pb2.FileDescriptorSet) -> None:
    msg = _find_message(fds, "ModelMetadataResponse")
    msg.field.remove(next(f for f in msg.field if f.name == "platform"))


def _drop_method(fds: descriptor_pb2.FileDescriptorSet) -> None:
    service = next(f for f in fds.file if f.name == SERVICE_FILE).service[0]
    service.method.remove(next(m for m in service.method if m.name == "LogSettings"))


def _unstream(fds: descriptor_pb2.FileDescriptorSet) -> None:
    service = next(f for f in fds.file if f.name == SERVICE_FILE).service[0]
    next(m for m in service.method if m.name == "ModelStreamInfer").client_streaming = False


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (_renumber, "field inference.ModelInferRequest.InferInputTensor.shape: number"),
        (_retype, "field inference.ModelConfig.max_batch_size: type"),
        (_relabel, "field inference.ModelInferRequest.raw_input_contents: label"),
        (_retarget, "field inference.ModelStreamInferResponse.infer_response: type_name"),
        (_out_of_oneof, "field inference.InferParameter.uint64_param: oneof"),
        (_enum_value, "enum inference.DataType.TYPE_BF16: number 15"),
        (_drop_field, "inference.ModelMetadataResponse.platform: missing"),
        (_drop_method, "rpc inference.GRPCInferenceService.LogSettings: missing"),
        (_unstream, "rpc inference.GRPCInferenceService.ModelStreamInfer:"),
    ],
)
def test_comparison_detects_drift(
    descriptor_set: descriptor_pb2.FileDescriptorSet,
    mutate: Callable[[descriptor_pb2.FileDescriptorSet], None],
    expected: str,
) -> None:
    """The comparison itself must catch each kind of incompatibility, naming where."""
    mutated = descriptor_pb2.FileDescriptorSet()
    mutated.CopyFrom(descriptor_set)
    mutate(mutated)
    problems = compare_all(load_pool(mutated))
    assert any(p.startswith(expected) for p in problems), problems


def test_generated_code_is_current(tmp_path: Path) -> None:
    """mpsd/proto/*_pb2* must be what `make proto` would write from proto/ now."""
    on_disk = sorted(GENERATED_DIR.glob("*_pb2*.py*"))
    if not on_disk:
        pytest.skip("generated modules not built (run `make proto`)")
    rc = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            *map(str, PROTO_FILES),
        ]
    )
    assert rc == 0, "protoc failed regenerating mpsd/proto"
    fresh = sorted((tmp_path / "mpsd" / "proto").iterdir())
    assert fresh, "protoc produced nothing"
    stale = [
        p.name
        for p in fresh
        if not (GENERATED_DIR / p.name).is_file() or (GENERATED_DIR / p.name).read_bytes() != p.read_bytes()
    ]
    assert not stale, f"out of date with proto/ (run `make proto`): {stale}"
