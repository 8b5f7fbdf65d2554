"""Model configs generated from the config schema itself, served by a real daemon beside a healthy model.

Every field of `ModelConfig` (walked through its JSON schema, so a field added later is generated too) is
drawn with valid values and invalid ones: wrong types, numbers out of range, unknown enum strings, unknown
keys, every instance kind and memory fractions from -1 to 3. Many generated models share one daemon: most
are there when it starts, a few more are loaded through RepositoryModelLoad while it runs. For each config
the daemon answers ServerLive within seconds, the healthy model serves, the generated model is READY or
UNAVAILABLE with a reason, and `mpsd validate` refuses the same configs as the daemon, apart from what only
this host can tell (named in `host_refusal`).

CI draws a fixed set of EXAMPLES configs (from a fixed seed); `MPSD_PROPERTY_EXAMPLES=500` draws more (one
daemon per PER_DAEMON of them) and `MPSD_PROPERTY_SEED=<n>` a different set.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml
from hypothesis import HealthCheck, Phase, given, reject, seed, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from mpsd.config.model_config import DEFAULT_FILENAMES, ModelConfig
from mpsd.daemon.core.residency.manager import NOT_LOADED_YET
from mpsd.daemon.supervise.gpus import cuda_gpu_count
from mpsd.daemon.supervise.placement import check_memory_budget, plan_instances
from mpsd.errors import ConfigError
from tests import models
from tests.conftest import DAEMON_GPUS, ROOT, RunningDaemon

pytestmark = pytest.mark.skipif(
    sys.platform != "linux", reason="host_refusal knows which kinds a Linux host's workers can run"
)

EXAMPLES = int(os.environ.get("MPSD_PROPERTY_EXAMPLES", "25"))
SEED = os.environ.get("MPSD_PROPERTY_SEED")
PER_DAEMON = 25  # generated models per daemon; the last LATE of them come through RepositoryModelLoad
LATE = 5
CHUNK = 200  # configs drawn in one run of hypothesis
ROUNDS = max(1, math.ceil(EXAMPLES / PER_DAEMON))
# Workers the generated models of one daemon may start together (each imports torch: about 2 s of CPU);
# a config that would go past it is made to load on demand instead.
WORKER_BUDGET = 16
MODEL_WORKERS = 3
LIVE_BOUND_S = 10.0  # "within a few seconds", on a busy two-core CI machine
CUDA_GPUS = cuda_gpu_count({**os.environ, **DAEMON_GPUS})
SAME_NAME = "<the model's folder>"  # `name` equal to the folder, which is only chosen when written

SCHEMA = ModelConfig.model_json_schema()
DEFS: dict[str, Any] = SCHEMA["$defs"]
Path_ = tuple[str, ...]  # a field's place: property names, "[]" for a list's items, "{}" for a map's values

# ---- values from the schema ------------------------------------------------------------------------------


@st.composite
def rarely(draw: st.DrawFn, common: st.SearchStrategy[Any], rare: st.SearchStrategy[Any]) -> Any:
    """`rare` one time in eight, else `common`."""
    return draw(rare if draw(st.integers(0, 7)) == 0 else common)


# Valid values of a field, where the schema's own range would start slow workers or never meet the host's
# cases: small dims and counts, the fractions around each device's range, GPU lists with repeats.
FRACTIONS = [-1.0, -0.5, 0, 0.0, 0.25, 0.5, 0.75, 1, 1.0, 1.5, 2, 2.0, 2.5, 3.0]
TENSOR_NAMES = ["INPUT0", "INPUT1", "OUTPUT0", "x", "y"]
BYTES = [1, 2**20, 2**30, 2**40]
DIMS = rarely(st.lists(st.sampled_from([-1, 1, 2, 3, 4]), max_size=3), st.sampled_from([[0], [2, -2], [-3]]))
HINTS: dict[Path_, st.SearchStrategy[Any]] = {
    ("name",): st.sampled_from([SAME_NAME] * 5 + ["someone_else"]),
    # every backend, more often the two this test has model files for (torchscript: add_sub; python: any)
    ("backend",): st.sampled_from(SCHEMA["properties"]["backend"]["enum"] + ["torchscript", "python"] * 2),
    ("max_batch_size",): st.sampled_from([0, 1, 2, 8, 1024]),
    ("default_model_filename",): rarely(
        st.sampled_from(["custom.pt", "custom.py", "model.pt2", ""]),
        st.sampled_from([".", "../escape.pt", "a/b.py"]),
    ),
    ("input", "[]", "name"): st.sampled_from(TENSOR_NAMES),
    ("output", "[]", "name"): st.sampled_from(TENSOR_NAMES),
    ("input", "[]", "dims"): DIMS,
    ("output", "[]", "dims"): DIMS,
    # every kind of the schema, and now and then one it does not know
    ("instance_group", "[]", "kind"): rarely(
        st.sampled_from(DEFS["InstanceGroup"]["properties"]["kind"]["enum"]),
        st.sampled_from(["KIND_BOGUS", "kind_gpu", "GPU"]),
    ),
    ("instance_group", "[]", "count"): st.integers(1, 2),
    ("instance_group", "[]", "gpus"): rarely(
        st.lists(st.integers(0, 3), min_size=1, max_size=2, unique=True), st.sampled_from([[], [0, 0]])
    ),
    ("instance_group", "[]", "memory_fraction"): st.sampled_from(FRACTIONS) | st.floats(-1, 3),
    ("version_policy", "latest", "num_versions"): st.integers(1, 3),
    ("version_policy", "specific", "versions", "[]"): st.integers(1, 3),
    ("parameters",): st.fixed_dictionaries(
        {},
        optional={
            "mps_fallback": rarely(
                st.sampled_from(["true", "false", "1", True]), st.sampled_from(["maybe", "2"])
            ),
            "intra_op_thread_count": rarely(
                st.sampled_from(["1", " 2 ", 2]), st.sampled_from(["0", "-1", 2.5])
            ),
            "INTRA_OP_THREAD_COUNT": rarely(st.just("1"), st.just("two")),
            "custom": st.text("abc", max_size=3),
        },
    ),
    ("dynamic_batching", "max_queue_delay_microseconds"): st.integers(0, 1000),
    ("dynamic_batching", "preferred_batch_size", "[]"): st.integers(1, 8),
    ("dynamic_batching", "max_queue_size"): st.integers(0, 8),
    ("dynamic_batching", "default_timeout_microseconds"): st.sampled_from([0, 1, 10**6]),
    ("max_device_memory_bytes",): st.sampled_from(BYTES),
    ("max_rss_bytes",): st.sampled_from(BYTES),
    ("residency", "footprint_bytes"): st.sampled_from(BYTES),
    ("residency", "keep_alive_s"): st.sampled_from([0, 0.5, 600, "never"]) | st.floats(0, 10**6),
    ("model_warmup", "[]", "name"): st.sampled_from(["zeros", "w"]),
    ("model_warmup", "[]", "batch_size"): st.integers(1, 2),
    ("model_warmup", "[]", "count"): st.integers(1, 2),
    ("model_warmup", "[]", "inputs", "{}", "dims"): st.lists(st.integers(1, 4), max_size=2),
    ("model_warmup", "[]", "inputs"): st.dictionaries(
        st.sampled_from(TENSOR_NAMES),
        st.builds(
            lambda data_type, dims, source: {"data_type": data_type, "dims": dims, **source},
            st.sampled_from(["TYPE_FP32", "TYPE_INT64"]),
            st.lists(st.integers(1, 4), max_size=2),
            rarely(
                st.sampled_from([{"zero_data": True}, {"random_data": True}]),
                st.sampled_from([{}, {"zero_data": True, "random_data": True}]),
            ),
        ),
        max_size=2,
    ),
    ("optimization", "cuda", "graph_spec", "[]", "batch_size"): st.integers(1, 16),
    # op libraries: one the test writes into every model folder, one missing, two outside the folder
    ("op_libraries", "[]"): rarely(
        st.just("ops.py"), st.sampled_from(["missing_ops.so", "../outside.py", "/etc/hostname"])
    ),
}
# How many items a list gets (drawn from these), and how often an optional field is present (in sixths).
LIST_SIZES: dict[Path_, list[int]] = {
    ("input",): [1, 1, 2],
    ("output",): [1, 1, 2],
    ("instance_group",): [0, 1, 1, 1, 1, 1, 1, 2, 2, 2],
    ("model_warmup",): [0, 1],
}
PRESENCE: dict[Path_, int] = {
    ("max_batch_size",): 5,
    ("model_warmup",): 1,
    ("version_policy", "latest"): 1,
    ("version_policy", "all"): 1,
    ("version_policy", "specific"): 1,
    ("optimization", "compile"): 1,
    ("optimization", "cuda", "graph_spec"): 1,
    ("instance_group",): 4,
    ("instance_group", "[]", "kind"): 5,
    ("instance_group", "[]", "memory_fraction"): 2,
    ("instance_group", "[]", "gpus"): 2,
}
# One value in this many is drawn from the invalid ones; 0: none (a config whose fields are all valid, which
# rules across fields, placement and the repository may still refuse).
ODDS = [0, 0, 0, 0, 0, 0, 10, 25]
# Values of a type a field does not take, by the JSON type they are not.
FOREIGN: dict[str, list[Any]] = {
    "string": ["bogus"],
    "integer": [7, -3],
    "number": [2.5, float("nan"), float("inf")],
    "boolean": ["maybe"],
    "array": [[1, "x"]],
    "object": [{"bogus": 1}],
    "null": [None],
}


def resolve(node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        node = DEFS[node["$ref"].rsplit("/", 1)[1]]
    return node


def json_types(node: dict[str, Any]) -> set[str]:
    """The JSON types a field takes (an integer is a number too)."""
    node = resolve(node)
    if "anyOf" in node:
        return set().union(*(json_types(branch) for branch in node["anyOf"]))
    kind = node.get("type", "object")
    return {kind, "number"} if kind == "integer" else {kind}


def valid(node: dict[str, Any], path: Path_, odds: int) -> st.SearchStrategy[Any]:
    """Values the schema accepts for the field (rules across fields may still refuse them); the fields
    inside it are invalid once in `odds`."""
    if path in HINTS:
        return HINTS[path]
    node = resolve(node)
    if "anyOf" in node:
        return st.one_of([valid(branch, path, odds) for branch in node["anyOf"]])
    if "const" in node:
        return st.just(node["const"])
    if "enum" in node:
        return st.sampled_from(node["enum"])
    kind = node.get("type", "object")
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind in ("integer", "number"):
        low = node.get("minimum", node.get("exclusiveMinimum", -1) + (kind == "integer"))
        high = node.get("maximum", low + 8)
        return st.integers(low, high) if kind == "integer" else st.floats(low, high)
    if kind == "string":
        return st.text("abcxyz_0", min_size=node.get("minLength", 0), max_size=8)
    if kind == "array":
        return items(node["items"], path, odds)
    if "properties" in node:
        return mapping(node, path, odds)
    values = value(node.get("additionalProperties", {}), (*path, "{}"), odds)
    return st.dictionaries(st.text("abcxyz", min_size=1, max_size=6), values, max_size=2)


@st.composite
def items(draw: st.DrawFn, node: dict[str, Any], path: Path_, odds: int) -> list[Any]:
    size = draw(st.sampled_from(LIST_SIZES.get(path, [0, 1, 1, 2])))
    return [draw(value(node, (*path, "[]"), odds)) for _ in range(size)]


def invalid(node: dict[str, Any], path: Path_) -> st.SearchStrategy[Any]:
    """Values the schema (or the rules on the field) refuses: a foreign type, a number past a bound, an
    unknown enum string, an empty or too long string, an object with an unknown key."""
    node = resolve(node)
    types = json_types(node)
    options: list[Any] = [v for kind, values in FOREIGN.items() if kind not in types for v in values]
    branches = [resolve(b) for b in node.get("anyOf", [node])]
    for branch in branches:
        if "minimum" in branch:
            options.append(branch["minimum"] - 1)
        if "exclusiveMinimum" in branch:
            options.append(branch["exclusiveMinimum"])
        if "maximum" in branch:
            options.append(branch["maximum"] + 1)
        if "enum" in branch or "const" in branch:
            known = branch.get("enum", [branch.get("const")])
            options += [f"{known[0]}_BOGUS", str(known[-1]).lower() + "x"]
        if branch.get("type") == "string":
            if branch.get("minLength"):
                options.append("")
            if "maxLength" in branch:
                options.append("n" * (branch["maxLength"] + 1))
        if branch.get("type") == "array" and "minimum" in resolve(branch["items"]):
            options.append([resolve(branch["items"])["minimum"] - 1])
    strategies = [st.sampled_from(options)] if options else []
    objects = [b for b in branches if "properties" in b]
    strategies += [mapping(b, path, 0).map(lambda m: {**m, "bogus_field": 1}) for b in objects]
    return st.one_of(strategies) if strategies else st.just({"bogus_field": 1})


@st.composite
def value(draw: st.DrawFn, node: dict[str, Any], path: Path_, odds: int) -> Any:
    if odds and draw(st.integers(0, odds - 1)) == 0:
        return draw(invalid(node, path))
    return draw(valid(node, path, odds))


@st.composite
def mapping(draw: st.DrawFn, node: dict[str, Any], path: Path_, odds: int) -> dict[str, Any]:
    """An object of the schema: its required fields (one left out once in `odds`), each optional one
    present as often as PRESENCE says (a third of the time unless it says so), each value valid or not."""
    required = set(node.get("required", []))
    out: dict[str, Any] = {}
    for key, sub in node.get("properties", {}).items():
        where = (*path, key)
        if key in required:
            present = not odds or draw(st.integers(0, 3 * odds - 1)) > 0
        else:
            present = draw(st.integers(0, 5)) < PRESENCE.get(where, 2)
        if present:
            out[key] = draw(value(sub, where, odds))
    return out


# ---- the models the configs are served with ------------------------------------------------------------

# One model file for a `backend: python` config of any inputs and outputs: zeros of each output's type and
# shape, so that whether it loads is the config's doing.
ANY_CONFIG_MODEL = """
import torch

DTYPES = {
    "BOOL": torch.bool, "UINT8": torch.uint8, "INT8": torch.int8, "INT16": torch.int16, "INT32": torch.int32,
    "INT64": torch.int64, "FP16": torch.float16, "BF16": torch.bfloat16, "FP32": torch.float32,
    "FP64": torch.float64,
}


class Model:
    def __init__(self, config, device):
        self.device = device
        self.batching = config["max_batch_size"] > 0
        self.outputs = [
            (o["name"], DTYPES[o["datatype"]], [1 if d == -1 else d for d in o["dims"]])
            for o in config["outputs"]
        ]

    def infer(self, inputs):
        batch = [next(iter(inputs.values())).shape[0]] if self.batching else []
        return {n: torch.zeros(batch + dims, dtype=t, device=self.device) for n, t, dims in self.outputs}
"""
ADD_SUB_TENSORS = {
    "input": [{"name": f"INPUT{i}", "data_type": "TYPE_FP32", "dims": [4]} for i in (0, 1)],
    "output": [{"name": f"OUTPUT{i}", "data_type": "TYPE_FP32", "dims": [4]} for i in (0, 1)],
}
TENSOR = resolve(SCHEMA["properties"]["input"]["items"])


@st.composite
def add_sub_tensors(draw: st.DrawFn, key: str, odds: int) -> list[dict[str, Any]]:
    """The add_sub TorchScript model's own inputs or outputs, sometimes with one field made invalid: other
    valid tensors would fail its warm-up, which `mpsd validate` does not run."""
    tensors = [dict(t) for t in ADD_SUB_TENSORS[key]]
    if odds and draw(st.integers(0, 2)) == 0:
        which = draw(st.sampled_from(sorted(TENSOR["properties"])))
        tensors[draw(st.integers(0, 1))][which] = draw(
            invalid(TENSOR["properties"][which], (key, "[]", which))
        )
    return tensors


@st.composite
def matching_warmup(draw: st.DrawFn, config: dict[str, Any]) -> list[dict[str, Any]]:
    """A warm-up sample that feeds the config's own inputs (one drawn field by field rarely does)."""
    batch = config.get("max_batch_size", 0)
    sample = {
        "name": "matching",
        "batch_size": draw(st.integers(1, 2)) if isinstance(batch, int) and batch >= 2 else 1,
        "count": draw(st.integers(1, 2)),
        "inputs": {
            t["name"]: {
                "data_type": t.get("data_type"),
                "dims": [d if d != -1 else draw(st.integers(1, 3)) for d in t["dims"]],
                draw(st.sampled_from(["zero_data", "random_data"])): True,
            }
            for t in config.get("input", [])
        },
    }
    return [sample]


def with_name(raw: dict[str, Any], name: str) -> dict[str, Any]:
    return {**raw, "name": name} if raw.get("name") == SAME_NAME else raw


def parsed(raw: dict[str, Any], name: str = "m000") -> ModelConfig | None:
    try:
        return ModelConfig.model_validate(with_name(raw, name))
    except (ValidationError, ValueError, TypeError):
        return None


def planned_workers(raw: dict[str, Any]) -> int:
    """Workers the daemon would start for the config at once (an upper bound: it may still refuse it)."""
    config = parsed(raw)
    if config is None or config.residency.load == "on_demand":
        return 0
    try:
        return len(plan_instances(config, cuda_gpus=CUDA_GPUS))
    except Exception:  # refused (or an error the daemon must contain, which the test then shows)
        return 0


@st.composite
def model_config(draw: st.DrawFn, workers_left: int) -> dict[str, Any]:
    """One config.yaml as a dict: every field of the schema drawn, then tied to a model file that loads."""
    odds = draw(st.sampled_from(ODDS))
    raw = draw(mapping(SCHEMA, (), odds))
    if raw.get("backend", "torchscript") == "torchscript":
        for key in ("input", "output"):
            if key in raw:
                raw[key] = draw(add_sub_tensors(key, odds))
    inputs = raw.get("input")
    named = isinstance(inputs, list) and all(
        isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("dims"), list)
        for t in inputs
    )
    if named and draw(st.integers(0, 2)) == 0:
        raw["model_warmup"] = draw(matching_warmup(raw))
    optimization: Any = raw.get("optimization")
    # torch.compile of a valid python model takes tens of seconds per worker on a CPU (the tests of
    # optimization.compile cover it); other backends' compile is refused or has no model file here
    if raw.get("backend") == "python" and isinstance(optimization, dict):
        optimization = {k: v for k, v in optimization.items() if not (k == "compile" and isinstance(v, dict))}
        raw["optimization"] = optimization
    if planned_workers(raw) > min(MODEL_WORKERS, workers_left):
        residency = raw.setdefault("residency", {})
        if isinstance(residency, dict):
            residency["load"] = "on_demand"
    return raw


def draw_configs(n: int) -> list[dict[str, Any]]:
    """n configs, the same on every run (another set with MPSD_PROPERTY_SEED); each daemon's share within
    the worker budget.

    Each is one example of hypothesis's. All but the last of a run of hypothesis are rejected once recorded:
    it mutates the examples it accepts into near-copies of themselves, and each config should be drawn
    afresh. It gives up after some hundreds of rejections, so a run draws at most CHUNK of them, from its
    own seed.
    """
    drawn: list[dict[str, Any]] = []
    used = [0]
    for chunk in range(math.ceil(n / CHUNK)):
        wanted = min(n, len(drawn) + CHUNK)

        @seed(int(SEED or 0) * 100_000 + chunk)
        @settings(
            max_examples=1,
            database=None,
            deadline=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(st.data())
        def collect(data: st.DataObject) -> None:
            if len(drawn) % PER_DAEMON == 0:
                used[0] = 0
            raw = data.draw(model_config(WORKER_BUDGET - used[0]))
            used[0] += planned_workers(raw)
            drawn.append(raw)
            if len(drawn) < wanted:  # noqa: B023 - each run of hypothesis is over before the next begins
                reject()

        collect()
    assert len(drawn) == n, f"hypothesis gave {len(drawn)} of {n} examples"
    return drawn


@cache
def generated() -> tuple[dict[str, Any], ...]:
    return tuple(draw_configs(EXAMPLES))


@cache
def add_sub_file(directory: Path) -> Path:
    path = directory / "add_sub.pt"
    models.save_torchscript(models.AddSub(), path)
    return path


def write_model(repo: Path, name: str, raw: dict[str, Any], torchscript: Path) -> None:
    """The config as YAML, and the model file the backend reads where the config names a plain file name
    (a python model's only as a .py file, which is what it imports); none for torch_export and aoti."""
    model_dir = repo / name
    models.write_config(model_dir, with_name(raw, name))
    (model_dir / "ops.py").write_text("# registers no ops\n")
    version = model_dir / "1"
    version.mkdir()
    backend = raw.get("backend", "torchscript")
    filename = raw.get("default_model_filename") or DEFAULT_FILENAMES.get(str(backend), "model.pt")
    if not isinstance(filename, str) or "/" in filename or filename in (".", ".."):
        return
    if backend == "torchscript":
        shutil.copy(torchscript, version / filename)
    elif backend == "python" and filename.endswith(".py"):
        (version / filename).write_text(ANY_CONFIG_MODEL)


# Configs this test found refused by one of the daemon and validate and not the other, kept in every run
# (hypothesis's @example): no instance group at all (no worker would serve it; the daemon showed it
# UNAVAILABLE without a reason), and memory fractions over 1.0 on one device in one model alone (the daemon
# refuses it whatever runs beside it, at the start or when it loads on demand).
FOUND: dict[str, dict[str, Any]] = {
    "found_no_instance_group": {**ADD_SUB_TENSORS, "instance_group": []},
    "found_fractions_over_one": {
        **ADD_SUB_TENSORS,
        "instance_group": [{"kind": "KIND_AUTO", "count": 2, "memory_fraction": 0.75}],
    },
    "found_fractions_over_one_on_demand": {
        **ADD_SUB_TENSORS,
        "instance_group": [{"kind": "KIND_AUTO", "memory_fraction": f} for f in (0.5, 0.75)],
        "residency": {"load": "on_demand"},
    },
}


# ---- what only this host can tell ----------------------------------------------------------------------


def host_refusal(raw: dict[str, Any], name: str) -> str | None:
    """Why this Linux host's workers cannot run a config that `mpsd validate` accepts, else None: which
    devices work is known only to the host that serves (validate's own docstring says so)."""
    config = parsed(raw, name)
    if config is None or config.residency.load == "on_demand":
        return None  # not started at all
    try:
        plans = plan_instances(config, cuda_gpus=CUDA_GPUS)
    except ConfigError:
        return None  # refused by placement rules, which validate judges
    for plan in plans:
        pinned = config.instance_group[plan.group].gpus is not None
        if plan.kind == "KIND_MPS":
            return "KIND_MPS: MPS exists only on macOS"
        if plan.kind != "KIND_GPU" or (config.optimization.gpu_accelerator == "mps" and not pinned):
            continue  # KIND_AUTO and KIND_CPU run on the CPU at least, as does KIND_GPU with the accelerator
        if CUDA_GPUS == 0:
            return "KIND_GPU (or gpus) on a host without a CUDA GPU"
        if plan.gpu is not None and plan.gpu >= CUDA_GPUS:
            return f"gpus lists GPU {plan.gpu}; the daemon may use {CUDA_GPUS}"
    return None


def refused_together(raw: dict[str, Any], name: str, reason: str) -> bool:
    """Refused by the memory budget for the fractions of other models beside it, not its own: whether
    models fit together is the host's (each daemon holds many generated models), not one config's."""
    config = parsed(raw, name)
    if config is None or not reason.startswith("memory budget exceeded"):
        return False
    try:
        return not check_memory_budget({name: plan_instances(config, cuda_gpus=CUDA_GPUS)})
    except ConfigError:
        return False


def cold(reason: str) -> bool:
    """Known and not running by design: loads on demand, or unloaded after its keep-alive."""
    return reason == NOT_LOADED_YET or reason.startswith(("unloaded after", "evicted for"))


# ---- one daemon, many generated models ----------------------------------------------------------------


@dataclass
class Round:
    daemon: RunningDaemon
    configs: dict[str, dict[str, Any]]  # generated model name -> the config written
    live_after_s: float
    rows: dict[str, dict[str, str]]  # the index once every model has settled
    loaded: dict[str, str | None] = field(default_factory=dict)  # model -> RepositoryModelLoad's error
    validate: dict[str, dict[str, Any]] = field(default_factory=dict)  # model -> its report
    problems: dict[str, list[str]] = field(default_factory=dict)  # model -> validate's problems

    def show(self, name: str) -> str:
        """The config and both verdicts, for an assertion message."""
        row = self.rows.get(name, {})
        return (
            f"\n--- {name}: daemon {row.get('state')} {row.get('reason', '')!r}; validate "
            f"{'ok' if self.validate.get(name, {}).get('ok') else self.problems.get(name)}; "
            f"RepositoryModelLoad {self.loaded.get(name, '-')}\n"
            + yaml.safe_dump(with_name(self.configs[name], name), sort_keys=False)
        )


def _index(daemon: RunningDaemon) -> dict[str, dict[str, str]]:
    rows = daemon.client.get_model_repository_index(as_json=True, client_timeout=10).get("models", [])
    return {row["name"]: row for row in rows}


def _wait_live(daemon: RunningDaemon, timeout: float) -> None:
    _waiting(daemon, lambda: bool(daemon.client.is_server_live(client_timeout=5)), timeout, "ServerLive")


def _wait_settled(daemon: RunningDaemon, timeout: float) -> None:
    """Until no model is LOADING (a broken one is UNAVAILABLE)."""

    def settled() -> bool:
        return all(row.get("state") != "LOADING" for row in _index(daemon).values())

    _waiting(daemon, settled, timeout, "every model settled")


def _waiting(daemon: RunningDaemon, predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Every call with a deadline, so that a daemon that hangs or exits fails the test, with its log, instead
    of hanging it."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if daemon.proc.poll() is not None:
            raise AssertionError(
                f"the daemon exited ({daemon.proc.returncode}) before {what}:\n{daemon.log()}"
            )
        try:
            if predicate():
                return
        except Exception as exc:
            last = exc
        time.sleep(0.1)
    raise AssertionError(f"no {what} within {timeout} s (last error: {last}):\n{daemon.log()[-6000:]}")


def _validate(repo: Path) -> tuple[dict[str, dict[str, Any]], dict[str, list[str]]]:
    done = subprocess.run(
        [sys.executable, "-m", "mpsd", "validate", str(repo), "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    report = json.loads(done.stdout)
    problems: dict[str, list[str]] = {}
    for problem in report["problems"]:
        problems.setdefault(problem["model"], []).append(f"{problem['field']}: {problem['problem']}")
    return {m["name"]: m for m in report["models"]}, problems


def infer_add_sub(client: grpcclient.InferenceServerClient) -> list[float]:
    a = np.arange(4, dtype=np.float32).reshape(1, 4)
    inputs = [grpcclient.InferInput(n, [1, 4], "FP32") for n in ("INPUT0", "INPUT1")]
    for tensor in inputs:
        tensor.set_data_from_numpy(a)
    out = client.infer("add_sub", inputs, client_timeout=30).as_numpy("OUTPUT0")
    assert out is not None
    return [float(x) for x in out[0]]


@pytest.fixture(scope="module", params=range(ROUNDS))
def round_(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Round]:
    tmp = tmp_path_factory.mktemp(f"property{request.param}")
    share = generated()[request.param * PER_DAEMON : (request.param + 1) * PER_DAEMON]
    configs = {f"m{request.param * PER_DAEMON + i:03d}": raw for i, raw in enumerate(share)}
    late = list(configs)[-LATE:] if len(configs) > LATE else []
    if request.param == 0:
        configs.update(FOUND)
    repo = tmp / "repo"
    models.add_sub(repo, dims=4)
    torchscript = add_sub_file(tmp)
    for name, raw in configs.items():
        if name not in late:
            write_model(repo, name, raw, torchscript)
    daemon_config = tmp / "mpsd.yaml"
    # explicit: the late models load through RepositoryModelLoad only. Every device gets a byte budget no
    # generated footprint reaches: whether models fit a host's memory together is the host's, not a config's.
    budget = {key: 2**62 for key in ("cpu", "mps", *(f"cuda:{i}" for i in range(4)))}
    daemon_config.write_text(
        yaml.safe_dump(
            {
                "model_control": "explicit",
                "metrics_address": "off",
                "front_processes": 0,
                "drain_timeout_s": 2,
                "worker_stop_timeout_s": 2,
                "memory_budget_bytes": budget,
            }
        )
    )
    started = time.monotonic()
    daemon = RunningDaemon(repo, tmp / "daemon.log", config=daemon_config)
    try:
        _wait_live(daemon, 60)
        live_after_s = time.monotonic() - started
        _wait_settled(daemon, 180)
        observed = Round(daemon, configs, live_after_s, _index(daemon))
        for name in late:
            write_model(repo, name, configs[name], torchscript)
        observed.validate, observed.problems = _validate(repo)
        # A model that loads on demand is only placed at the scan; the daemon's verdict on the rest of what
        # validate refuses (its memory budget) comes when it loads, which RepositoryModelLoad asks for now.
        to_load = late + [
            name
            for name, row in observed.rows.items()
            if name in configs and cold(row.get("reason", "")) and not observed.validate[name]["ok"]
        ]

        def load(name: str) -> str | None:
            try:
                daemon.client.load_model(name, client_timeout=180)
            except Exception as exc:
                return str(exc) or type(exc).__name__
            return None

        with ThreadPoolExecutor(max(len(to_load), 1)) as pool:
            observed.loaded = dict(zip(to_load, pool.map(load, to_load), strict=True))
        _wait_settled(daemon, 180)
        observed.rows = _index(daemon)
        yield observed
    finally:
        daemon.stop()
        daemon.kill_group()


def test_the_generator_covers_every_field_of_the_schema() -> None:
    """Every property of every object in the schema is drawn, with valid and invalid values, and every
    instance kind: a field added to ModelConfig is generated without a change here."""
    seen: set[Path_] = set()
    kinds: set[str] = set()

    def walk(value: Any, path: Path_) -> None:
        if isinstance(value, dict):
            for key, sub in value.items():
                seen.add((*path, key))
                walk(sub, (*path, key))
        elif isinstance(value, list):
            for item in value:
                walk(item, (*path, "[]"))
        if path == ("instance_group", "[]") and isinstance(value, dict):
            kinds.add(repr(value.get("kind")))

    configs = draw_configs(300)
    for raw in configs:
        walk(raw, ())
    wanted: set[Path_] = set()

    def fields(node: dict[str, Any], path: Path_) -> None:
        node = resolve(node)
        for branch in node.get("anyOf", []):
            fields(branch, path)
        if node.get("type") == "array":
            fields(node["items"], (*path, "[]"))
        for key, sub in node.get("properties", {}).items():
            if (*path, key) not in wanted:
                wanted.add((*path, key))
                fields(sub, (*path, key))

    fields(SCHEMA, ())
    missing = {p for p in wanted if p not in seen and ("[]" not in p or p[:-1] in seen)}
    assert not missing, sorted(missing)
    named = {"'KIND_AUTO'", "'KIND_GPU'", "'KIND_MPS'", "'KIND_CPU'", "None"}  # None: left out
    assert named < kinds, kinds  # and some value that is no kind
    valid_count = sum(parsed(raw) is not None for raw in configs)
    assert 0.2 < valid_count / len(configs) < 0.8, valid_count  # a mix of both


def test_the_daemon_answers_server_live_within_seconds(round_: Round) -> None:
    """However broken the models beside it: their work is no part of the daemon's start."""
    assert round_.live_after_s < LIVE_BOUND_S, round_.daemon.log()[-3000:]
    assert round_.daemon.proc.poll() is None and round_.daemon.client.is_server_live(client_timeout=10)


def test_the_healthy_model_serves_beside_them(round_: Round) -> None:
    """One model's trouble stays that model's."""
    assert round_.rows["add_sub"]["state"] == "READY", round_.rows["add_sub"]
    assert infer_add_sub(round_.daemon.client) == [0.0, 2.0, 4.0, 6.0]


def test_each_generated_model_is_ready_or_unavailable_with_its_reason(round_: Round) -> None:
    """Never stuck LOADING, never refused without saying why, never an error of mpsd's own ("internal
    error": something the isolation boundary caught that a check should have named)."""
    wrong = []
    for name in round_.configs:
        row = round_.rows.get(name, {})
        state, reason = row.get("state"), row.get("reason", "")
        unexplained = state == "UNAVAILABLE" and not reason
        internal = reason.startswith("internal error")  # a fault in mpsd that the config met, contained
        if state not in ("READY", "UNAVAILABLE") or unexplained or internal:
            wrong.append(round_.show(name))
    assert not wrong, "".join(wrong)


def test_mpsd_validate_refuses_the_configs_the_daemon_refuses(round_: Round) -> None:
    """A config refused by one and not the other is a disagreement, except where this host cannot run
    what validate accepts (the daemon must then refuse it) or where other models took the memory budget."""
    wrong = []
    for name, raw in round_.configs.items():
        row = round_.rows.get(name, {})
        reason = row.get("reason", "")
        refused = row.get("state") == "UNAVAILABLE" and not cold(reason)
        expected = not round_.validate[name]["ok"] or host_refusal(raw, name) is not None
        if refused != expected and not (refused and refused_together(raw, name, reason)):
            wrong.append(round_.show(name) + f"host: {host_refusal(raw, name) if expected else None}\n")
    assert not wrong, "".join(wrong)


def test_repository_model_load_fails_exactly_for_the_refused_ones(round_: Round) -> None:
    """Each model loaded through RepositoryModelLoad: the call fails, with the reason the index then shows,
    exactly when the model is refused."""
    if not round_.loaded:
        pytest.skip("no model of this round is loaded through RepositoryModelLoad")
    wrong = []
    for name, error in round_.loaded.items():
        row = round_.rows.get(name, {})
        refused = row.get("state") == "UNAVAILABLE" and not cold(row.get("reason", ""))
        if refused != (error is not None) or (error is not None and row.get("reason", "") not in error):
            wrong.append(round_.show(name))
    assert not wrong, "".join(wrong)
    assert infer_add_sub(round_.daemon.client) == [0.0, 2.0, 4.0, 6.0]
