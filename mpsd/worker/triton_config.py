"""Triton's auto-complete of a python model's config (`TritonPythonModel.auto_complete_config(config)` with
`triton_python_backend_utils.ModelConfig`), and what mpsd does with it.

In Triton the returned config becomes the model's. mpsd decided the model's config in the daemon, from the
config file, before the worker started (batching, placement and the clients' checks follow it), so a
model's auto-complete can only confirm it: one that leaves it as written loads, one that would change it
is refused at load, naming the changes to write into the config file instead.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any


class ModelConfig:
    """The config an `auto_complete_config` sees and edits, with Triton's rules for each edit."""

    def __init__(self, model_config: str) -> None:
        self._model_config: dict[str, Any] = json.loads(model_config)

    def _name(self) -> str:
        return str(self._model_config.get("name", ""))

    def as_dict(self) -> dict[str, Any]:
        return self._model_config

    def set_max_batch_size(self, max_batch_size: int) -> None:
        configured = int(self._model_config.get("max_batch_size", 0))
        if configured > max_batch_size:
            raise ValueError(
                f"configuration specified max_batch_size {configured}, but in auto-complete-config function "
                f"for model '{self._name()}' specified max_batch_size {max_batch_size}"
            )
        self._model_config["max_batch_size"] = max_batch_size

    def set_dynamic_batching(self) -> None:
        for other in ("sequence_batching", "ensemble_scheduling"):
            if other in self._model_config:
                raise ValueError(
                    f"Configuration specified scheduling_choice as '{other}', but auto-complete-config "
                    f"function for model '{self._name()}' tries to set scheduling_choice as "
                    "'dynamic_batching'"
                )
        self._model_config.setdefault("dynamic_batching", {})

    def add_input(self, input: Mapping[str, Any]) -> None:
        self._add("input", dict(input), ("name", "data_type", "dims", "optional"))

    def add_output(self, output: Mapping[str, Any]) -> None:
        self._add("output", dict(output), ("name", "data_type", "dims"))

    def _add(self, kind: str, tensor: dict[str, Any], allowed: tuple[str, ...]) -> None:
        """Add a tensor, or complete the one of that name: its data type and dims must agree with what the
        config already says (an unset data type or empty dims agrees with anything)."""
        where = f"in auto-complete-config function for model '{self._name()}'"
        extra = [key for key in tensor if key not in allowed]
        if extra:
            raise ValueError(f"{kind} '{tensor.get('name')}' {where} has properties other than {allowed}")
        for key in ("name", "data_type", "dims"):
            if key not in tensor:
                raise ValueError(f"{kind} '{tensor.get('name', '')}' {where} is missing '{key}' property.")
        existing = self._model_config.setdefault(kind, [])
        for current in existing:
            if current.get("name") != tensor["name"]:
                continue
            configured = current.get("data_type", "TYPE_INVALID")
            if configured != "TYPE_INVALID" and configured != tensor["data_type"]:
                raise ValueError(
                    f"unable to load model '{self._name()}', configuration expects datatype {configured} "
                    f"for {kind} '{tensor['name']}', model provides {tensor['data_type']}"
                )
            if current.get("dims") and list(current["dims"]) != list(tensor["dims"]):
                raise ValueError(
                    f"model '{self._name()}', tensor '{tensor['name']}': the model expects dims "
                    f"{tensor['dims']} but the model configuration specifies dims {current['dims']}"
                )
            if "optional" in current and "optional" in tensor and current["optional"] != tensor["optional"]:
                raise ValueError(
                    f"model '{self._name()}', tensor '{tensor['name']}': the model expects optional "
                    f"{tensor['optional']} but the model configuration specifies optional "
                    f"{current['optional']}"
                )
            current.update(tensor)
            return
        existing.append(tensor)

    def set_model_transaction_policy(self, transaction_policy_dict: Mapping[str, Any]) -> None:
        extra = [key for key in transaction_policy_dict if key != "decoupled"]
        if extra:
            raise ValueError(
                f"model transaction property in auto-complete-config function for model '{self._name()}' "
                "contains property other than 'decoupled'."
            )
        policy = self._model_config.setdefault("model_transaction_policy", {})
        if "decoupled" in transaction_policy_dict:
            wanted = bool(transaction_policy_dict["decoupled"])
            if "decoupled" in policy and bool(policy["decoupled"]) != wanted:
                raise ValueError(
                    "trying to change decoupled property in auto-complete-config for model "
                    f"'{self._name()}', which is already set to '{policy['decoupled']}'."
                )
            policy["decoupled"] = wanted


def changes(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    """What an auto-complete changed, field by field (tensors by name), in words."""
    said = []
    for key in sorted(set(before) | set(after)):
        old, new = before.get(key), after.get(key)
        if key in ("input", "output"):
            olds = {t.get("name"): t for t in old or ()}
            for tensor in new or ():
                name = tensor.get("name")
                if name not in olds:
                    said.append(f"adds {key} '{name}'")
                elif olds[name] != tensor:
                    said.append(f"changes {key} '{name}' to {json.dumps(tensor)}")
        elif old != new:
            said.append(f"sets {key} to {json.dumps(new)}" if new is not None else f"removes {key}")
    return said


def check_auto_complete(model_class: type, config: Mapping[str, Any]) -> None:
    """Run the model's `auto_complete_config` (if it has one) on its config; refuse a change (ValueError)."""
    auto_complete = getattr(model_class, "auto_complete_config", None)
    if auto_complete is None:
        return
    completed = auto_complete(ModelConfig(json.dumps(config)))
    after = completed.as_dict() if isinstance(completed, ModelConfig) else None
    if after is None:
        raise ValueError("auto_complete_config must return the pb_utils.ModelConfig it was given")
    said = changes(copy.deepcopy(dict(config)), after)
    if said:
        raise ValueError(
            "auto_complete_config " + "; ".join(said) + ": mpsd reads a model's config from its config file "
            "only (the daemon batches, places and checks requests by it before the model loads), so write "
            "this into config.pbtxt"
        )
