"""How a generating model's responses make an OpenAI answer, in one process (api/openai/generation.py's
Progress): the finish reason is the last one a response gave (an empty one says nothing: a final response
without text or reason keeps the reason given before it), and without a usage output the completion's
tokens are the responses that carried text."""

from __future__ import annotations

from mpsd.config.model_config import OpenAIConfig
from mpsd.daemon.api.openai.generation import Progress
from mpsd.daemon.api.operations import Answered
from mpsd.daemon.dataplane.request import InferResult, OutputTensor
from mpsd.ipc import strings


def _text(name: str, value: str) -> OutputTensor:
    return OutputTensor(name, "BYTES", (1,), strings.serialize([value.encode()]))


def _response(text: str, finish: str | None = None) -> Answered:
    outputs = [_text("TEXT", text)]
    if finish is not None:
        outputs.append(_text("FINISH", finish))
    return Answered(InferResult("writer", 1, tuple(outputs)), frozenset())


def _progress(finish: bool) -> Progress:
    section = OpenAIConfig.model_validate(
        {
            "task": "chat",
            "input": "MESSAGES",
            "output": "TEXT",
            **({"finish_reason_output": "FINISH"} if finish else {}),
        }
    )
    return Progress(section)


def test_the_finish_reason_is_the_last_one_given_not_an_empty_one_after_it() -> None:
    progress = _progress(finish=True)
    for answered in (_response("a", ""), _response(" b", "stop"), _response("", "")):
        progress.take(answered)
    progress.end()
    assert progress.finish == "stop"
    assert "".join(progress.text) == "a b"


def test_a_later_reason_replaces_an_earlier_one() -> None:
    progress = _progress(finish=True)
    for answered in (_response("a", "stop"), _response("b", "length")):
        progress.take(answered)
    assert progress.finish == "length"


def test_without_a_usage_output_the_completion_tokens_are_the_responses_with_text() -> None:
    progress = _progress(finish=False)
    for text in ("one", "", " two", "", " three", ""):  # empty ones: a model's final, keep-alive responses
        progress.take(_response(text))
    progress.end()
    assert progress.usage_dict() == {"prompt_tokens": 0, "completion_tokens": 3, "total_tokens": 3}
