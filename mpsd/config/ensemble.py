"""Ensembles (Triton's `platform: "ensemble"`): a model whose requests run through other models, step by
step, as its `ensemble_scheduling` maps tensors between them.

A step's `input_map` says, for each input of the step's model, which ensemble tensor feeds it (an input
of the ensemble or an output of another step); its `output_map` names each output of the step's model
that becomes an ensemble tensor. The steps form a graph that must be acyclic and complete: every tensor a
step reads is made before it, by exactly one producer, and every output of the ensemble is made.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field


class EnsembleStep(BaseModel):
    """One step: a model (and version: -1 for the latest ready one) and how its tensors map."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_name: Annotated[str, Field(min_length=1)]
    model_version: Annotated[int, Field(ge=-1)] = -1  # 0 means -1 too (a config.pbtxt that leaves it out)
    input_map: dict[str, str] = {}  # the step model's input -> the ensemble tensor that feeds it
    output_map: dict[str, str] = {}  # the step model's output -> the ensemble tensor it makes


class EnsembleScheduling(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    step: Annotated[list[EnsembleStep], Field(min_length=1)]


def step_label(index: int, step: EnsembleStep) -> str:
    return f"step {index} (model '{step.model_name}')"


def graph_problem(inputs: Sequence[str], outputs: Sequence[str], steps: Sequence[EnsembleStep]) -> str | None:
    """What is wrong with the ensemble's graph, or None: each tensor made once, every read tensor made,
    every output made, no cycle."""
    producer: dict[str, str] = {name: "the ensemble's inputs" for name in inputs}
    for i, step in enumerate(steps):
        if not step.output_map:
            return f"{step_label(i, step)} maps no output: it would contribute nothing"
        for tensor in step.output_map.values():
            if tensor in producer:
                made = producer[tensor]
                return f"ensemble tensor '{tensor}' is made twice: by {made} and {step_label(i, step)}"
            producer[tensor] = step_label(i, step)
    for i, step in enumerate(steps):
        for tensor in step.input_map.values():
            if tensor not in producer:
                return f"{step_label(i, step)} reads ensemble tensor '{tensor}', which no input or step makes"
    for name in outputs:
        if name not in producer or name in inputs:
            return f"ensemble output '{name}' is not made by any step"
    if order(inputs, steps) is None:
        return "the steps form a cycle: each waits for a tensor another of them makes"
    return None


def order(inputs: Sequence[str], steps: Sequence[EnsembleStep]) -> list[int] | None:
    """An order in which the steps can run one after the other (their indices), or None for a cycle."""
    made = set(inputs)
    left = list(range(len(steps)))
    ordered: list[int] = []
    while left:
        runnable = [i for i in left if set(steps[i].input_map.values()) <= made]
        if not runnable:
            return None
        for i in runnable:
            made.update(steps[i].output_map.values())
            left.remove(i)
            ordered.append(i)
    return ordered
