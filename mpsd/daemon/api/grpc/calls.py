"""A ModelInferRequest as the inference call both adapters hand on (`api.call`): names, shapes, parameters
with their kinds, typed contents by field, and the raw contents (the request's own, or the views the wire
split cut out of its bytes)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mpsd.daemon.api.call import (
    NO_PARAMS,
    TYPED_CONTENTS,
    InferCall,
    InputCall,
    OutputCall,
    Param,
    Params,
    RawEntry,
)


def params(parameters: Mapping[str, Any]) -> Params:
    """InferParameters by key, each as its kind and value ("" and "" for one with no value set)."""
    if not parameters:
        return NO_PARAMS
    found = {}
    for key, value in parameters.items():
        choice = value.WhichOneof("parameter_choice")
        found[key] = Param(choice.removesuffix("_param"), getattr(value, choice)) if choice else Param("", "")
    return found


def _contents(tensor: Any) -> dict[str, Sequence[Any]]:
    if not tensor.HasField("contents"):
        return {}
    contents = tensor.contents
    return {f: values for f in TYPED_CONTENTS if len(values := getattr(contents, f))}


def infer_call(request: Any, raw: Sequence[RawEntry] | None = None) -> InferCall:
    """The call a ModelInferRequest makes; `raw`, when given, stands for its raw_input_contents."""
    return InferCall(
        request.model_name,
        request.model_version,
        request.id,
        params(request.parameters),
        tuple(
            InputCall(t.name, t.datatype, tuple(t.shape), params(t.parameters), _contents(t))
            for t in request.inputs
        ),
        tuple(OutputCall(o.name, params(o.parameters)) for o in request.outputs),
        tuple(request.raw_input_contents) if raw is None else raw,
    )
