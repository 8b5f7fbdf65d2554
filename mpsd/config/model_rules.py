"""The rules of a model's config across its fields: what each field allows alone is the schema's
(`model_schema.py`); whether the fields go together (a decoupled model and the response cache, CUDA graphs
and variable shapes, an ensemble's steps, sequence batching's controls, the `openai` section's tensors,
warm-up samples against the inputs) is checked here, once the fields are read.

A broken rule is a `RuleError` naming the field it is about, so that `error_loc` can place it.
"""

from __future__ import annotations

from typing import Any

from pydantic_core import ErrorDetails

from mpsd.config.ensemble import graph_problem
from mpsd.config.model_schema import DATATYPES_BY_CONFIG, DynamicBatching, ModelFields, Optimization
from mpsd.config.shape_buckets import check_buckets

# Backends whose model torch.compile can compile at load (optimization.compile).
COMPILABLE = ("torch_export", "python")
# The data types an embeddings output may have: floats, sent to clients as float32.
EMBEDDING_TYPES = ("TYPE_FP16", "TYPE_BF16", "TYPE_FP32", "TYPE_FP64")
USAGE_TYPES = ("TYPE_INT32", "TYPE_INT64", "TYPE_UINT32", "TYPE_UINT64")


class RuleError(ValueError):
    """A rule across fields is broken; `loc` is the field it is about. pydantic reports such an error at
    the top level (loc ()) but keeps this exception, so that `error_loc` can still place it."""

    def __init__(self, loc: tuple[str | int, ...], message: str) -> None:
        super().__init__(message)
        self.loc = loc


def error_loc(err: ErrorDetails) -> tuple[str | int, ...]:
    """Where a validation error is: pydantic's own location, else the field a broken rule names."""
    if err["loc"]:
        return tuple(err["loc"])
    error = err.get("ctx", {}).get("error")
    return error.loc if isinstance(error, RuleError) else ()


def _check_graphs(config: ModelFields) -> None:
    """A CUDA graph is recorded at fixed shapes: every input's shape must be known but for the batch.

    Its errors are plain ValueErrors, placed at the whole file: each message names the optimization fields.
    """
    cuda = config.optimization.cuda
    if not cuda.graphs:
        if cuda.graph_spec:
            raise ValueError("optimization.cuda.graph_spec is set but optimization.cuda.graphs is false")
        return
    if config.max_batch_size == 0:
        raise ValueError("optimization.cuda.graphs needs max_batch_size > 0 (graphs are kept per batch size)")
    if config.backend == "python":
        # Python code around the tensors would run once, when recorded, and never again.
        raise ValueError("optimization.cuda.graphs is for torchscript and torch_export models, not python")
    # A bucketed dim has a few sizes, each recorded: only dims no bucket fixes must be fixed.
    bucketed = {n: b.dim - 1 for n, b in config.shape_buckets.inputs.items()} if config.shape_buckets else {}
    variable = [
        t.name for t in config.input if -1 in [d for i, d in enumerate(t.dims) if bucketed.get(t.name) != i]
    ]
    if variable:
        raise ValueError(
            "optimization.cuda.graphs needs fixed input dims (or shape_buckets for them); variable (-1) in: "
            + ", ".join(variable)
        )
    optional = [t.name for t in config.input if t.optional]
    if optional:
        raise ValueError("optimization.cuda.graphs cannot record optional inputs: " + ", ".join(optional))
    too_large = sorted({g.batch_size for g in cuda.graph_spec if g.batch_size > config.max_batch_size})
    if too_large:
        raise ValueError(
            f"optimization.cuda.graph_spec batch_size {too_large[0]} exceeds max_batch_size "
            f"{config.max_batch_size}"
        )


def _check_compile(config: ModelFields) -> None:
    if config.optimization.compile is None:
        return
    if config.optimization.cuda.graphs:
        raise RuleError(
            ("optimization", "compile"),
            "optimization.compile and optimization.cuda.graphs do not go together: use compile mode "
            "reduce-overhead, which records CUDA graphs of the compiled model itself",
        )
    if config.backend not in COMPILABLE:
        why = (
            "an AOTInductor package is compiled already"
            if config.backend == "aoti"
            else "TorchScript runs in its own interpreter, which torch.compile cannot trace"
        )
        raise RuleError(
            ("optimization", "compile"),
            f"optimization.compile is for torch_export and python models, not {config.backend}: {why}",
        )


_WARMUP = ("model_warmup",)
_SCHEDULING = ("ensemble_scheduling",)


def _check_priorities(db: DynamicBatching | None) -> None:
    """Triton's rules for priority levels, in its words (a config that Triton refuses is refused)."""
    if db is None:
        return
    if db.default_queue_policy is not None and (db.max_queue_size or db.default_timeout_microseconds):
        raise RuleError(
            ("dynamic_batching", "default_queue_policy"),
            "max_queue_size and default_timeout_microseconds beside default_queue_policy are its fields: "
            "give them in default_queue_policy",
        )
    levels = db.priority_levels
    if levels == 0:  # Triton ignores the other priority fields then
        return
    if not 0 < db.default_priority_level <= levels:
        raise RuleError(
            ("dynamic_batching", "default_priority_level"),
            f"default priority level must be in range [1, {levels}]",
        )
    for level in db.priority_queue_policy:
        if not 0 < level <= levels:
            raise RuleError(
                ("dynamic_batching", "priority_queue_policy"),
                f"priority queue policy must have priority level in range [1, {levels}]",
            )


def _check_ensemble(config: ModelFields) -> None:
    """An ensemble has steps and a graph that works, and nothing of a model that runs in a worker."""
    scheduling = config.ensemble_scheduling
    if config.backend != "ensemble":
        if scheduling is not None:
            raise RuleError(_SCHEDULING, "ensemble_scheduling is for ensembles (backend: ensemble)")
        return
    if scheduling is None:
        raise RuleError(_SCHEDULING, "an ensemble needs ensemble_scheduling with at least one step")
    for field in (
        "dynamic_batching",
        "op_libraries",
        "model_warmup",
        "max_device_memory_bytes",
        "max_rss_bytes",
    ):
        if getattr(config, field):
            raise RuleError(
                (field,), f"{field} is for models that run in workers; an ensemble runs its steps' models"
            )
    if config.optimization != Optimization():
        raise RuleError(("optimization",), "optimization is for the steps' models, not an ensemble")
    problem = graph_problem([t.name for t in config.input], [t.name for t in config.output], scheduling.step)
    if problem is not None:
        raise RuleError(_SCHEDULING, problem)


def _check_strings(config: ModelFields) -> None:
    """Strings reach only python models (as numpy arrays of bytes): torch has no tensor of strings."""
    if config.backend in ("python", "ensemble"):  # an ensemble's steps' models are checked themselves
        return
    for field in ("input", "output"):
        for i, t in enumerate(getattr(config, field)):
            if t.data_type == "TYPE_STRING":
                raise RuleError(
                    (field, i, "data_type"),
                    f"{field} '{t.name}' is TYPE_STRING, which a {config.backend} model cannot take or "
                    "return: torch has no string tensors; serve strings with a python model",
                )


_SEQUENCE = ("sequence_batching",)


def _check_sequence(config: ModelFields) -> None:
    """Sequence batching is the model's one scheduler; its controls and states are inputs and outputs of the
    model that clients never send or see, so their names are not the config's, and their types are known."""
    sb = config.sequence_batching
    if sb is None:
        return
    types = set(DATATYPES_BY_CONFIG)
    for other in ("dynamic_batching", "ensemble_scheduling"):
        if getattr(config, other) is not None:
            raise RuleError(
                _SEQUENCE, f"sequence_batching and {other} do not go together: a model has one scheduler"
            )
    if sb.state and config.backend not in ("python", "torchscript"):
        raise RuleError(
            _SEQUENCE, f"sequence_batching.state is for python and torchscript models, not {config.backend}"
        )
    if sb.state and config.optimization.cuda.graphs:
        raise RuleError(_SEQUENCE, "sequence_batching.state and optimization.cuda.graphs do not go together")
    if sb.state and config.model_transaction_policy.decoupled:
        raise RuleError(_SEQUENCE, "sequence_batching.state is not supported for a decoupled model")
    if sb.oldest is not None and config.max_batch_size > 0:
        too_large = [p for p in sb.oldest.preferred_batch_size if p > config.max_batch_size]
        if too_large:
            raise RuleError(
                _SEQUENCE,
                f"sequence_batching.oldest.preferred_batch_size {too_large[0]} exceeds max_batch_size "
                f"{config.max_batch_size}",
            )
    inputs, outputs = config.input_by_name, config.output_by_name
    for ci in sb.control_input:
        if ci.name in inputs:
            raise RuleError(
                _SEQUENCE,
                f"control input '{ci.name}' is also an input: the daemon fills it, so the config's input "
                "list leaves it out",
            )
        if ci.control[0].tensor_type not in types:
            raise RuleError(
                _SEQUENCE, f"control input '{ci.name}': unknown data_type {ci.control[0].tensor_type}"
            )
    for state in sb.state:
        where = f"sequence_batching.state '{state.input_name}'"
        if state.input_name in inputs or state.output_name in outputs:
            raise RuleError(
                _SEQUENCE,
                f"{where}: the state's input and output are not in the config's input and output lists",
            )
        if state.data_type not in types or state.data_type == "TYPE_STRING":
            raise RuleError(_SEQUENCE, f"{where}: data_type must be a numeric type, not {state.data_type}")
        for initial in state.initial_state:
            if initial.data_type != state.data_type or initial.dims != state.dims:
                raise RuleError(_SEQUENCE, f"{where}: initial_state must have the state's data_type and dims")


def _check_openai(config: ModelFields) -> None:
    """The inputs and outputs the `openai` section names exist, with types its endpoint can fill or read,
    and the daemon can send every input the model needs."""
    section = config.openai
    if section is None:
        return
    inputs, outputs = config.input_by_name, config.output_by_name
    text_out = section.task != "embeddings"
    named: list[tuple[str, str | None, dict[str, Any], tuple[str, ...]]] = [
        ("input", section.input, inputs, ("TYPE_STRING",)),
        ("output", section.output, outputs, ("TYPE_STRING",) if text_out else EMBEDDING_TYPES),
        ("finish_reason_output", section.finish_reason_output, outputs, ("TYPE_STRING",)),
        ("usage_output", section.usage_output, outputs, USAGE_TYPES),
    ]
    for field, name, tensors, types in named:
        if name is None:
            continue
        loc = ("openai", field)
        tensor = tensors.get(name)
        if tensor is None:
            kind = "input" if tensors is inputs else "output"
            raise RuleError(
                loc, f"openai.{field}: the model has no {kind} '{name}' (its: {', '.join(tensors)})"
            )
        if tensor.data_type not in types:
            raise RuleError(
                loc, f"openai.{field}: '{name}' is {tensor.data_type}; it must be {' or '.join(types)}"
            )
    generates = section.task in ("chat", "completions")
    if section.finish_reason_output is not None and not generates:
        raise RuleError(
            ("openai", "finish_reason_output"), "openai.finish_reason_output is for chat and completions"
        )
    if section.usage_output is not None and section.task == "transcription":
        raise RuleError(
            ("openai", "usage_output"), "openai.usage_output is for embeddings, chat and completions"
        )
    for field in ("truncate_dimensions", "tokens"):
        if getattr(section, field) and section.task != "embeddings":
            raise RuleError(("openai", field), f"openai.{field} is for embeddings")
    others = [t.name for t in config.input if t.name != section.input]
    if others:
        raise RuleError(
            ("openai",),
            "openai: a request through OpenAI's API gives the model openai.input only; the model has more "
            f"inputs: {', '.join(others)}",
        )
    if section.task == "embeddings" and config.model_transaction_policy.decoupled:
        raise RuleError(
            ("openai", "task"), "openai.task embeddings takes one response: the model is decoupled"
        )
    batched = config.max_batch_size > 0
    dims = inputs[section.input].dims
    if dims != [1] and (batched or section.task != "embeddings" or dims != [-1]):
        rows = "[1], or [-1] without batching" if section.task == "embeddings" else "[1]"
        raise RuleError(
            ("openai", "input"), f"openai.input '{section.input}' dims must be {rows}, not {dims}"
        )


def _check_warmup(config: ModelFields) -> None:
    """Every sample feeds every required input with a shape and type the model accepts."""
    configured = config.input_by_name
    for sample in config.model_warmup:
        where = f"model_warmup '{sample.name}'"
        unknown = sorted(set(sample.inputs) - set(configured))
        if unknown:
            raise RuleError(_WARMUP, f"{where}: unknown input(s) {', '.join(unknown)}")
        missing = [n for n in configured if n not in sample.inputs]
        if missing:  # optional ones too: mpsd always runs the model with every input
            raise RuleError(_WARMUP, f"{where}: no data for input(s) {', '.join(missing)}")
        if config.max_batch_size == 0 and sample.batch_size != 1:
            raise RuleError(_WARMUP, f"{where}: batch_size must be 1 for a model with max_batch_size 0")
        if sample.batch_size > max(config.max_batch_size, 1):
            raise RuleError(
                _WARMUP,
                f"{where}: batch_size {sample.batch_size} exceeds max_batch_size {config.max_batch_size}",
            )
        for name, data in sample.inputs.items():
            cfg = configured[name]
            if data.data_type != cfg.data_type:
                raise RuleError(_WARMUP, f"{where}: input '{name}' is {cfg.data_type}, not {data.data_type}")
            if len(data.dims) != len(cfg.dims) or any(
                c != -1 and c != d for c, d in zip(cfg.dims, data.dims, strict=True)
            ):
                raise RuleError(_WARMUP, f"{where}: input '{name}' dims {data.dims} do not match {cfg.dims}")


def check(config: ModelFields) -> None:
    """Every rule across the fields; the first one broken raises its `RuleError` (or a plain ValueError,
    placed at the whole file, for optimization's rules)."""
    for field in ("input", "output"):
        names = [t.name for t in getattr(config, field)]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise RuleError((field,), f"{field} names must be unique; repeated: {', '.join(dupes)}")
    if not config.input:
        raise RuleError(("input",), "input: at least one input is required")
    if not config.output:
        raise RuleError(("output",), "output: at least one output is required")
    if not config.instance_group:  # no worker would ever serve it
        raise RuleError(
            ("instance_group",),
            "instance_group: at least one group is required; leave it out for one KIND_AUTO instance",
        )
    if config.dynamic_batching is not None and config.max_batch_size == 0:
        raise RuleError(("dynamic_batching",), "dynamic_batching needs max_batch_size > 0")
    _check_ensemble(config)
    _check_priorities(config.dynamic_batching)
    if config.model_transaction_policy.decoupled and config.response_cache.enable:
        raise RuleError(
            ("response_cache", "enable"),
            "a decoupled model's responses are a stream, which the response cache does not keep",
        )
    if config.model_transaction_policy.decoupled:
        if config.backend not in ("python", "ensemble"):
            raise RuleError(
                ("model_transaction_policy", "decoupled"),
                "decoupled models are python models whose infer yields its responses (backend: python)",
            )
        if config.dynamic_batching is not None:
            raise RuleError(
                ("dynamic_batching",),
                "a decoupled model runs each request on its own: remove dynamic_batching",
            )
    _check_strings(config)
    _check_sequence(config)
    _check_openai(config)
    _check_warmup(config)
    try:
        check_buckets(config)
    except ValueError as exc:
        raise RuleError(("shape_buckets",), str(exc)) from None
    _check_graphs(config)
    _check_compile(config)
