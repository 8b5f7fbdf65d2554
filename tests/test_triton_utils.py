"""mpsd's `triton_python_backend_utils` against Triton's, in-process: every public name of Triton's module is
in docs/triton-python-models.md's table, and each row says the truth (a supported name is there, a refused
one is refused at load with the table's reason); the helpers answer what Triton's answer; an
auto_complete_config that would change the config is refused, naming the change."""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import pytest

from mpsd.worker import triton_utils as pb
from mpsd.worker.triton_config import check_auto_complete
from mpsd.worker.triton_refused import (
    REFUSED_ARGUMENTS,
    REFUSED_METHODS,
    REFUSED_NAMES,
    SEQUENCE_METHODS,
    refusals,
)
from tests.conftest import ROOT

# Triton's module (python_backend's src/resources/triton_python_backend_utils.py and what its stub sets
# on it: pb_stub.cc's StubSetup), and the methods of the objects it hands a model.
TRITON_NAMES = [
    "TRITON_STRING_TO_NUMPY",
    "serialize_byte_tensor",
    "deserialize_bytes_tensor",
    "get_input_tensor_by_name",
    "get_output_tensor_by_name",
    "get_input_config_by_name",
    "get_output_config_by_name",
    "using_decoupled_model_transaction_policy",
    "triton_to_numpy_type",
    "numpy_to_triton_type",
    "triton_string_to_numpy",
    "ModelConfig",
    "TRITONSERVER_REQUEST_FLAG_SEQUENCE_START",
    "TRITONSERVER_REQUEST_FLAG_SEQUENCE_END",
    "TRITONSERVER_RESPONSE_COMPLETE_FINAL",
    "TRITONSERVER_REQUEST_RELEASE_ALL",
    "TRITONSERVER_REQUEST_RELEASE_RESCHEDULE",
    "TritonError",
    "TritonModelException",
    "Tensor",
    "InferenceRequest",
    "InferenceResponse",
    "Logger",
    "PreferredMemory",
    "TRITONSERVER_MEMORY_GPU",
    "TRITONSERVER_MEMORY_CPU",
    "MetricFamily",
    "load_model",
    "unload_model",
    "is_model_ready",
    "Tensor.name",
    "Tensor.as_numpy",
    "Tensor.triton_dtype",
    "Tensor.to_dlpack",
    "Tensor.is_cpu",
    "Tensor.shape",
    "Tensor.from_dlpack",
    "Tensor.__dlpack__",
    "InferenceRequest.inputs",
    "InferenceRequest.request_id",
    "InferenceRequest.correlation_id",
    "InferenceRequest.flags",
    "InferenceRequest.set_flags",
    "InferenceRequest.timeout",
    "InferenceRequest.parameters",
    "InferenceRequest.trace",
    "InferenceRequest.exec",
    "InferenceRequest.async_exec",
    "InferenceRequest.requested_output_names",
    "InferenceRequest.get_response_sender",
    "InferenceRequest.is_cancelled",
    "InferenceRequest.set_release_flags",
    "InferenceResponse.output_tensors",
    "InferenceResponse.has_error",
    "InferenceResponse.error",
    "InferenceResponse.parameters",
    "InferenceResponseSender.send",
    "InferenceResponseSender.is_cancelled",
    "ResponseIterator.cancel",
    "TritonError.UNKNOWN",
]

ROW = re.compile(r"^\| `([^`]+)` \| (supported|refused|refused for sequence models) \| ?(.*?) ?\|$")


def _table() -> dict[str, tuple[str, str]]:
    text = (ROOT / "docs" / "triton-python-models.md").read_text()
    return {m[1]: (m[2], m[3]) for line in text.splitlines() if (m := ROW.match(line))}


def _resolve(name: str) -> Any:
    target: Any = pb
    for part in name.split("."):
        target = getattr(target, part)
    return target


def _use(name: str) -> str:
    """A model's source that uses `name` the way a Triton model does."""
    if name.endswith("(parameters=...)"):
        cls = name.split("(")[0]
        return f"import triton_python_backend_utils as pb_utils\nr = pb_utils.{cls}(parameters={{'a': 1}})\n"
    if "." in name:
        return f"def execute(request):\n    request.{name.split('.')[-1]}(0)\n"
    return f"import triton_python_backend_utils as pb_utils\nfamily = pb_utils.{name}\n"


def test_every_name_of_tritons_module_is_in_the_table() -> None:
    table = _table()
    assert not [n for n in TRITON_NAMES if n not in table], "names of Triton's module the table leaves out"


@pytest.mark.parametrize("name", sorted(_table()))
def test_each_row_of_the_table_is_true(name: str) -> None:
    status, note = _table()[name]
    used = _use(name)
    if status == "supported":
        assert _resolve(name) is not None
        assert refusals(used) == [], used
        return
    reason = {
        **REFUSED_NAMES,
        **REFUSED_METHODS,
        **SEQUENCE_METHODS,
        **{f"{cls}({arg}=...)": why for (cls, arg), why in REFUSED_ARGUMENTS.items()},
    }[name if "(" in name else name.split(".")[-1]]
    assert reason in note, (reason, note)
    if status == "refused for sequence models":
        assert _resolve(name) is not None and refusals(used) == []
        (found,) = refusals(used, sequence=True)
    else:
        (found,) = refusals(used)
    assert (found.line, found.reason) == (2, reason), found
    if name in REFUSED_NAMES:  # reached through getattr, it fails with the same reason
        with pytest.raises(AttributeError, match=re.escape(reason)):
            getattr(pb, name)


def test_refused_uses_are_found_however_the_module_is_imported() -> None:
    source = (
        "from triton_python_backend_utils import MetricFamily\n"
        "import triton_python_backend_utils\n"
        "x = triton_python_backend_utils.load_model('m')\n"
    )
    assert [(r.line, r.what) for r in refusals(source)] == [
        (1, "triton_python_backend_utils.MetricFamily"),
        (3, "triton_python_backend_utils.load_model"),
    ]


def test_helpers_answer_what_tritons_answer() -> None:
    assert pb.numpy_to_triton_type(np.float32) == 11 and pb.numpy_to_triton_type(np.bytes_) == 13
    assert pb.triton_to_numpy_type(8) is np.int32 and pb.triton_to_numpy_type(99) is None
    assert pb.triton_string_to_numpy("TYPE_BOOL") is bool
    strings = np.array([[b"ab", "c\u00e9"], [b"", b"xyz"]], dtype=np.object_)
    packed = pb.serialize_byte_tensor(strings)
    assert packed[:6] == b"\x02\x00\x00\x00ab"
    assert pb.deserialize_bytes_tensor(packed).tolist() == [b"ab", "c\u00e9".encode(), b"", b"xyz"]
    assert pb.serialize_byte_tensor(np.zeros(0, dtype=np.object_)) == ()
    assert pb.serialize_byte_tensor(np.zeros(2, dtype=np.float32)) is None
    config = {"input": [{"name": "X"}], "model_transaction_policy": {"decoupled": True}}
    assert pb.get_input_config_by_name(config, "X") == {"name": "X"}
    assert pb.get_output_config_by_name(config, "Y") is None
    assert pb.using_decoupled_model_transaction_policy(config) is True
    assert pb.Tensor("x", np.zeros(2, dtype=np.float32)).triton_dtype() == 11
    with pytest.raises(pb.TritonModelException, match="a response's parameters are not sent"):
        pb.InferenceResponse(parameters={"a": 1})


CONFIG = {
    "name": "m",
    "max_batch_size": 8,
    "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [4]}],
    "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": [4]}],
    "model_transaction_policy": {"decoupled": False},
}


def test_an_auto_complete_that_confirms_the_config_loads_one_that_changes_it_is_refused() -> None:
    class Confirms:
        @staticmethod
        def auto_complete_config(config: pb.ModelConfig) -> pb.ModelConfig:
            config.set_max_batch_size(8)
            config.add_input({"name": "X", "data_type": "TYPE_FP32", "dims": [4]})
            config.set_model_transaction_policy({"decoupled": False})
            return config

    class Adds:
        @staticmethod
        def auto_complete_config(config: pb.ModelConfig) -> pb.ModelConfig:
            config.add_output({"name": "Z", "data_type": "TYPE_INT32", "dims": [1]})
            config.set_dynamic_batching()
            return config

    class Contradicts:
        @staticmethod
        def auto_complete_config(config: pb.ModelConfig) -> pb.ModelConfig:
            config.add_input({"name": "X", "data_type": "TYPE_FP16", "dims": [4]})
            return config

    check_auto_complete(Confirms, json.loads(json.dumps(CONFIG)))
    with pytest.raises(ValueError) as info:
        check_auto_complete(Adds, CONFIG)
    assert "sets dynamic_batching to {}; adds output 'Z'" in str(info.value)
    assert "write this into config.pbtxt" in str(info.value)
    with pytest.raises(ValueError, match="configuration expects datatype TYPE_FP32 for input 'X'"):
        check_auto_complete(Contradicts, CONFIG)
