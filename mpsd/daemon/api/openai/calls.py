"""From an OpenAI request's texts to the inference call KServe's adapters also make (`api.call`), and from
an answer's outputs back to values: strings in, strings or floats out.

Each text is one row of the model's `openai.input` (TYPE_STRING, dims [1]); the request's other fields are
the call's parameters (`openai.parameters`). A model with batching takes up to `max_batch_size`
rows in one call (and batches calls of several requests together); one without takes a row per call, or
every row at once when its input's dims are [-1].
"""

from __future__ import annotations

import codecs
import math
from collections.abc import AsyncGenerator, Sequence
from typing import Any

import numpy as np

from mpsd.config.model_config import ModelConfig, OpenAIConfig
from mpsd.daemon.api.call import InferCall, InputCall, OutputCall, Params
from mpsd.daemon.api.operations import Answered, Operations
from mpsd.daemon.api.tracing import Incoming
from mpsd.daemon.dataplane.request import InferResult, OutputTensor
from mpsd.errors import Internal
from mpsd.ipc import strings

STRINGS = strings.DATATYPE


def rows_per_call(config: ModelConfig, section: OpenAIConfig) -> int | None:
    """How many texts one call may carry (None: any number)."""
    if config.max_batch_size > 0:
        return config.max_batch_size
    return None if config.input_by_name[section.input].dims == [-1] else 1


def chunks(items: Sequence[bytes], size: int | None) -> list[Sequence[bytes]]:
    if size is None or len(items) <= size:
        return [items]
    return [items[i : i + size] for i in range(0, len(items), size)]


def text_call(
    name: str, config: ModelConfig, section: OpenAIConfig, texts: Sequence[bytes], parameters: Params
) -> InferCall:
    """One call with `texts` as rows of the model's input, and the request's `parameters`."""
    rows = len(texts)
    shape: tuple[int, ...] = (rows, 1) if config.max_batch_size > 0 else (rows,)
    inputs = (InputCall(section.input, STRINGS, shape),)
    wanted = [section.output, section.usage_output, section.finish_reason_output]
    outputs = tuple(OutputCall(n) for n in wanted if n is not None)
    return InferCall(
        name, "", parameters=parameters, inputs=inputs, outputs=outputs, raw=(strings.serialize(texts),)
    )


def output(result: InferResult, name: str) -> OutputTensor:
    for tensor in result.outputs:
        if tensor.name == name:
            return tensor
    raise Internal(f"model '{result.model}' gave no output '{name}'")  # asked for by name: never


def texts_of(tensor: OutputTensor) -> list[bytes]:
    return strings.split(tensor.data, math.prod(tensor.shape))


def floats(tensor: OutputTensor, rows: int) -> np.ndarray[Any, np.dtype[np.float32]]:
    """A float output as float32 rows (BF16 widened, FP16 and FP64 converted)."""
    if tensor.datatype == "FP32":
        array = np.frombuffer(tensor.data, "<f4")
    elif tensor.datatype == "BF16":
        array = (np.frombuffer(tensor.data, "<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        array = np.frombuffer(tensor.data, "<f2" if tensor.datatype == "FP16" else "<f8").astype(np.float32)
    return array.reshape(rows, -1)


def integers(tensor: OutputTensor) -> list[int]:
    dtype = {"INT32": "<i4", "INT64": "<i8", "UINT32": "<u4", "UINT64": "<u8"}[tensor.datatype]
    return [int(v) for v in np.frombuffer(tensor.data, dtype)]


class TextPieces:
    """A generating model's text, response by response: bytes that end inside a UTF-8 character wait for
    the rest, so a token split mid-character is never shown as a replacement character."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def add(self, data: bytes) -> str:
        return str(self._decoder.decode(data))

    def end(self) -> str:
        return str(self._decoder.decode(b"", final=True))


def answers(
    ops: Operations, call: InferCall, decoupled: bool, came: Incoming | None
) -> AsyncGenerator[Answered, None]:
    """The responses to a call: a decoupled model's as it yields them, an ordinary model's one; traced as
    any request is (`came`: what the HTTP request brought to its trace, `came_over_http`)."""
    return ops.answers(call, decoupled, came)
