"""`sequence_batching` read from a Triton config.pbtxt and config.yaml's fields, written back unchanged, and
the configs it cannot serve refused naming the field."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mpsd.config.model_file import validate_model_config
from mpsd.errors import ModelConfigError

ROOT = Path(__file__).resolve().parent.parent
# config.pbtxt's protobuf code cannot share this process with tritonclient's: it runs in a subprocess.
CONVERT = """
import json, sys
from mpsd.config.model_config import ModelConfig
from mpsd.config.pbtxt import pbtxt_to_dict
from mpsd.config.pbtxt_write import config_to_pbtxt
from mpsd.errors import ModelConfigError
answers = []
for text in json.loads(sys.stdin.read()):
    try:
        raw, ignored = pbtxt_to_dict(text)
        written = config_to_pbtxt(ModelConfig.model_validate(raw)) if "SKIP" not in text else ""
        answers.append([raw, list(ignored), pbtxt_to_dict(written)[0] if written else None])
    except (ModelConfigError, ValueError) as exc:
        answers.append(str(exc))
print(json.dumps(answers))
"""


def _convert(*texts: str) -> list[Any]:
    done = subprocess.run(
        [sys.executable, "-c", CONVERT], input=json.dumps(texts), capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    return list(json.loads(done.stdout))


PBTXT = """
name: "stateful"
backend: "python"
max_batch_size: 8
sequence_batching {
  max_sequence_idle_microseconds: 5000000
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "END" control [ { kind: CONTROL_SEQUENCE_END bool_false_true: [ false, true ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY fp32_false_true: [ 0, 1 ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_STRING } ] }
  ]
  oldest { max_candidate_sequences: 4 preferred_batch_size: [ 2, 4 ] max_queue_delay_microseconds: 100 }
  state [ {
    input_name: "STATE_IN" output_name: "STATE_OUT" data_type: TYPE_FP32 dims: [ 3 ]
    initial_state { data_type: TYPE_FP32 dims: [ 3 ] zero_data: true name: "zeros" }
    use_same_buffer_for_input_output: true
  } ]
}
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""


def _config(raw: dict[str, Any]) -> Any:
    return validate_model_config(Path("stateful/config.pbtxt"), raw)


def test_a_triton_sequence_config_is_read_and_written_back_unchanged() -> None:
    [(raw, ignored, written)] = _convert(PBTXT)
    assert ignored == [
        "sequence_batching.state.0.use_same_buffer_for_input_output (a memory setting of Triton's)",
    ]
    config = _config(raw)
    sb = config.sequence_batching
    assert sb.idle_s == 5.0
    assert [c.name for c in sb.control_input] == ["START", "END", "READY", "CORRID"]
    assert sb.control("CONTROL_SEQUENCE_END")[1].false_true == (False, True)
    assert sb.control("CONTROL_SEQUENCE_READY")[1].tensor_type == "TYPE_FP32"
    assert sb.control("CONTROL_SEQUENCE_CORRID")[1].tensor_type == "TYPE_STRING"
    assert sb.oldest.max_candidate_sequences == 4 and sb.oldest.preferred_batch_size == [2, 4]
    assert sb.state[0].initial_state[0].zero_data
    assert _config(written) == config


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (
            ("max_batch_size: 8", "max_batch_size: 8 dynamic_batching { }"),
            'another member of oneof "scheduling_choice"',
        ),
        (('name: "INPUT"', 'name: "START"'), "control input 'START' is also an input"),
        (("data_type: TYPE_STRING } ]", "data_type: TYPE_FP32 } ]"), "unexpected data type for control"),
        (("int32_false_true: [ 0, 1 ]", "int32_false_true: [ 0 ]"), "int32_false_true must have 2 entries"),
        (("preferred_batch_size: [ 2, 4 ]", "preferred_batch_size: [ 16 ]"), "exceeds max_batch_size 8"),
        (('backend: "python"', 'platform: "torch_aoti"'), "state is for python and torchscript models"),
        (
            ("max_sequence_idle_microseconds", "iterative_sequence: true max_sequence_idle_microseconds"),
            "iterative sequences",
        ),
    ],
)
def test_what_cannot_be_served_is_refused_naming_it(change: tuple[str, str], words: str) -> None:
    [answer] = _convert(PBTXT.replace(*change) + "# SKIP")
    if isinstance(answer, str):  # refused while read
        assert words in answer, answer
        return
    with pytest.raises(ModelConfigError) as refused:
        _config(answer[0])
    assert words in str(refused.value), str(refused.value)
