"""The schema of a model's `config.yaml`: Triton's field names and their types, each field checked on its
own, strictly.

Unknown keys are errors, not silently ignored, because a misspelt field that is ignored is a production
incident waiting to happen. The rules across fields are `model_rules.py`'s; `ModelConfig`
(`model_config.py`) is the schema validated by them.
"""

from __future__ import annotations

import functools
import itertools
from typing import Annotated, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from mpsd.config.ensemble import EnsembleScheduling
from mpsd.config.sequence import SequenceBatching
from mpsd.ipc.dtypes import DATATYPES, config_to_wire

# The config spelling of each of mpsd.ipc.dtypes.DATATYPES (a Literal, so that the schema lists them).
DataType = Literal[
    "TYPE_BOOL",
    "TYPE_UINT8",
    "TYPE_UINT16",
    "TYPE_UINT32",
    "TYPE_UINT64",
    "TYPE_INT8",
    "TYPE_INT16",
    "TYPE_INT32",
    "TYPE_INT64",
    "TYPE_FP16",
    "TYPE_BF16",
    "TYPE_FP32",
    "TYPE_FP64",
    "TYPE_STRING",
]
DATATYPES_BY_CONFIG = get_args(DataType)
Kind = Literal["KIND_AUTO", "KIND_GPU", "KIND_MPS", "KIND_CPU"]
Backend = Literal["torchscript", "torch_export", "aoti", "python", "ensemble"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TensorConfig(_Strict):
    """One input or output: name, element type and shape without the batch dimension (-1 = variable)."""

    name: Annotated[str, Field(min_length=1, max_length=256)]
    data_type: DataType
    dims: list[int]

    @field_validator("dims")
    @classmethod
    def _dims_valid(cls, dims: list[int]) -> list[int]:
        for d in dims:
            if d == 0 or d < -1:
                raise ValueError(f"dimension {d} is not allowed: use a positive size or -1 for variable")
        return dims

    # Kept once read (the config is frozen): every request's checks read them, at no call after the first.
    @functools.cached_property
    def wire_datatype(self) -> str:
        return config_to_wire(self.data_type)

    @functools.cached_property
    def itemsize(self) -> int | None:
        """Bytes per element; None for strings, whose elements have sizes of their own."""
        return DATATYPES[self.wire_datatype].itemsize


class InputConfig(TensorConfig):
    optional: bool = False
    # Triton's `format` (how an image's dimensions are laid out): described to clients, never acted on.
    format: Literal["FORMAT_NONE", "FORMAT_NHWC", "FORMAT_NCHW"] = "FORMAT_NONE"


class OutputConfig(TensorConfig):
    # Labels for the classification extension: a file in the model's folder, one label per line.
    label_filename: Annotated[str, Field(min_length=1)] | None = None


class InstanceGroup(_Strict):
    """Where and how many worker processes run this model (one process per instance)."""

    name: str | None = None
    kind: Kind = "KIND_AUTO"
    count: Annotated[int, Field(ge=1, le=64)] = 1
    gpus: list[Annotated[int, Field(ge=0)]] | None = None
    memory_fraction: float | None = None

    @field_validator("gpus")
    @classmethod
    def _gpus_unique(cls, gpus: list[int] | None) -> list[int] | None:
        if gpus is not None:
            if not gpus:
                raise ValueError("gpus must list at least one GPU index when given")
            if len(set(gpus)) != len(gpus):
                raise ValueError(f"gpus lists an index twice: {gpus}")
        return gpus


class LatestPolicy(_Strict):
    num_versions: Annotated[int, Field(ge=1)] = 1


class SpecificPolicy(_Strict):
    versions: list[Annotated[int, Field(ge=1)]]


class AllPolicy(_Strict):
    pass


class VersionPolicy(_Strict):
    """Which numeric version directories are served: the latest N (default 1), all, or a list."""

    latest: LatestPolicy | None = None
    all: AllPolicy | None = None
    specific: SpecificPolicy | None = None

    @model_validator(mode="after")
    def _one_choice(self) -> VersionPolicy:
        chosen = [k for k in ("latest", "all", "specific") if getattr(self, k) is not None]
        if len(chosen) > 1:
            raise ValueError(f"choose one of latest, all, specific (got {', '.join(chosen)})")
        return self

    def select(self, available: list[int]) -> list[int]:
        """The versions to serve out of those present on disk, ascending."""
        ordered = sorted(available)
        if self.all is not None:
            return ordered
        if self.specific is not None:
            return [v for v in ordered if v in set(self.specific.versions)]
        latest = self.latest or LatestPolicy()
        return ordered[-latest.num_versions :] if ordered else []


class QueuePolicy(_Strict):
    """Triton's ModelQueuePolicy: how the queue treats the requests of one priority level."""

    timeout_action: Literal["REJECT", "DELAY"] = "REJECT"
    default_timeout_microseconds: Annotated[int, Field(ge=0)] = 0
    allow_timeout_override: bool = False
    max_queue_size: Annotated[int, Field(ge=0)] = 0


class DynamicBatching(_Strict):
    """Triton's dynamic batching fields: requests are merged along the batch dimension.

    `max_queue_size` and `default_timeout_microseconds` beside the others are a short way to write the
    default queue policy's (`default_queue_policy`); one config uses one way or the other.
    """

    max_queue_delay_microseconds: Annotated[int, Field(ge=0)] = 0
    preferred_batch_size: list[Annotated[int, Field(ge=1)]] = []
    max_queue_size: Annotated[int, Field(ge=0)] = 0
    default_timeout_microseconds: Annotated[int, Field(ge=0)] = 0
    default_queue_policy: QueuePolicy | None = None
    priority_levels: Annotated[int, Field(ge=0)] = 0
    default_priority_level: Annotated[int, Field(ge=0)] = 0
    priority_queue_policy: dict[Annotated[int, Field(ge=0)], QueuePolicy] = {}

    @functools.cached_property
    def default_policy(self) -> QueuePolicy:
        """The queue policy of a level without one of its own (of every request, without levels)."""
        if self.default_queue_policy is not None:
            return self.default_queue_policy
        return QueuePolicy(
            max_queue_size=self.max_queue_size, default_timeout_microseconds=self.default_timeout_microseconds
        )

    def level(self, priority: int) -> int:
        """A request's level, as Triton sets it: 0 (none given) and levels above `priority_levels` are the
        default level; 0 for every request of a model without levels."""
        if self.priority_levels == 0:
            return 0
        return priority if 0 < priority <= self.priority_levels else self.default_priority_level

    def policy(self, level: int) -> QueuePolicy:
        return self.priority_queue_policy.get(level, self.default_policy)


class GraphSpec(_Strict):
    """One CUDA graph to record: the batch size it is recorded at (Triton's `graph_spec.batch_size`)."""

    batch_size: Annotated[int, Field(ge=1)]


class CudaOptimization(_Strict):
    """Triton's `optimization.cuda`: record the model's kernels as CUDA graphs and replay them."""

    graphs: bool = False
    graph_spec: list[GraphSpec] = []


class CompileOptimization(_Strict):
    """`torch.compile` at load (`optimization.compile`), for torch_export and python models."""

    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = "default"
    # None: torch's default (static shapes first, dynamic after a second shape); True: dynamic from the
    # start; False: one static graph per batch size.
    dynamic: bool | None = None


class Optimization(_Strict):
    cuda: CudaOptimization = CudaOptimization()
    compile: CompileOptimization | None = None
    # Triton's `execution_accelerators { gpu_execution_accelerator [{ name: "mps" }] }`: KIND_GPU and
    # KIND_AUTO groups use Apple's GPU where MPS is usable, CUDA where it is not but a CUDA GPU is, and else
    # the CPU with a warning, where plain KIND_GPU would fail to load (docs/devices.md).
    gpu_accelerator: Literal["mps"] | None = None
    # Run the forward pass under torch.autocast(<device type>, dtype); outputs keep their declared types.
    autocast: Literal["float16", "bfloat16"] | None = None


class TransactionPolicy(_Strict):
    """Triton's `model_transaction_policy`: a decoupled model answers with any number of responses."""

    decoupled: bool = False


class ResponseCacheConfig(_Strict):
    """Triton's `response_cache`: answer a request identical to an earlier one from the daemon's cache."""

    enable: bool = False


class ResidencyConfig(_Strict):
    """When the model is in memory. Unset fields take the daemon's `residency` defaults."""

    load: Literal["startup", "on_demand"] | None = None
    keep_alive_s: Annotated[float, Field(ge=0)] | Literal["never"] | None = None
    pinned: bool | None = None
    footprint_bytes: Annotated[int, Field(gt=0)] | None = None


OpenAITask = Literal["embeddings", "chat", "completions", "transcription"]


class OpenAIConfig(_Strict):
    """The model serves an endpoint of OpenAI's API (docs/openai.md): which one, and which of its inputs and
    outputs carry what."""

    task: OpenAITask
    # TYPE_STRING: each text (embeddings), the messages as JSON (chat), the prompt (completions), the
    # audio file's bytes (transcription)
    input: Annotated[str, Field(min_length=1)]
    # the embeddings (floats, one row per text), or the text (TYPE_STRING; each response's piece)
    output: Annotated[str, Field(min_length=1)]
    # the model reads the request's other fields (sampling, language, ...) as its request parameters
    parameters: bool = False
    # TYPE_STRING: why generation ended (`stop`, `length`, ...), "" while it goes on
    finish_reason_output: Annotated[str, Field(min_length=1)] | None = None
    # integers: tokens of each text (embeddings), or [prompt, completion] tokens so far (chat, completions)
    usage_output: Annotated[str, Field(min_length=1)] | None = None
    # embeddings: `dimensions` may ask for fewer: the first N values, scaled back to unit length
    truncate_dimensions: bool = False
    # embeddings: `input` may be token arrays, each reaching openai.input as its JSON text (`[101, 7592]`)
    tokens: bool = False


class WarmupInput(_Strict):
    """One input of a warm-up sample: type, shape without the batch dimension, and what fills it."""

    data_type: DataType
    dims: list[Annotated[int, Field(ge=1)]]
    zero_data: bool = False
    random_data: bool = False

    @model_validator(mode="after")
    def _one_source(self) -> WarmupInput:
        if self.zero_data == self.random_data:
            raise ValueError("set exactly one of zero_data, random_data")
        return self


class ModelWarmup(_Strict):
    """A synthetic request run before the model is marked ready, so first requests do not pay for
    lazy initialisation (Triton's `model_warmup`)."""

    name: Annotated[str, Field(min_length=1)]
    batch_size: Annotated[int, Field(ge=1)] = 1
    inputs: dict[str, WarmupInput]
    count: Annotated[int, Field(ge=1)] = 1


class BucketedInput(_Strict):
    """One variable dimension of an input and the sizes it is padded to (an mpsd extension)."""

    # The dimension's index in the tensor as the model gets it: with batching, 0 is the batch dimension
    dim: Annotated[int, Field(ge=0)]
    sizes: Annotated[list[Annotated[int, Field(ge=1)]], Field(min_length=1)]
    pad_value: float = 0

    @field_validator("sizes")
    @classmethod
    def _ascending(cls, sizes: list[int]) -> list[int]:
        if any(a >= b for a, b in itertools.pairwise(sizes)):
            raise ValueError(f"sizes must be strictly ascending: {sizes}")
        return sizes


class BucketedOutput(_Strict):
    """An output dimension as long as a bucketed input's: cut back to each request's real length."""

    dim: Annotated[int, Field(ge=0)]
    follows: Annotated[str, Field(min_length=1)]


class MaskInput(_Strict):
    """An input the daemon makes: 1 at a bucketed input's real positions, 0 at its padding."""

    name: Annotated[str, Field(min_length=1, max_length=256)]
    # the bucketed input whose positions it marks; may be left out when one input is bucketed
    follows: Annotated[str, Field(min_length=1)] | None = None
    data_type: DataType = "TYPE_INT64"


class ShapeBuckets(_Strict):
    """`shape_buckets`: variable input dims padded to a few sizes, so requests of different lengths share
    batches, CUDA graphs and compiled graphs (docs/configuration.md)."""

    inputs: Annotated[dict[str, BucketedInput], Field(min_length=1)]
    mask_input: MaskInput | None = None
    outputs: dict[str, BucketedOutput] = {}

    @field_validator("mask_input", mode="before")
    @classmethod
    def _mask_by_name(cls, value: object) -> object:
        return {"name": value} if isinstance(value, str) else value


class ModelFields(_Strict):
    """A model's config's fields, as read from `<repo>/<model>/config.yaml` (or mapped from `config.pbtxt`):
    `ModelConfig` (`model_config.py`) is these, checked by the rules across fields (`model_rules.py`)."""

    name: str | None = None
    backend: Backend = "torchscript"
    max_batch_size: Annotated[int, Field(ge=0)] = 0
    input: list[InputConfig]
    output: list[OutputConfig]
    instance_group: list[InstanceGroup] = [InstanceGroup()]
    version_policy: VersionPolicy = VersionPolicy()
    default_model_filename: str | None = None
    parameters: dict[str, str] = {}
    dynamic_batching: DynamicBatching | None = None
    max_device_memory_bytes: Annotated[int, Field(gt=0)] | None = None
    max_rss_bytes: Annotated[int, Field(gt=0)] | None = None
    allow_pickle: bool = False
    model_warmup: list[ModelWarmup] = []
    optimization: Optimization = Optimization()
    residency: ResidencyConfig = ResidencyConfig()
    model_transaction_policy: TransactionPolicy = TransactionPolicy()
    response_cache: ResponseCacheConfig = ResponseCacheConfig()
    # The steps of an ensemble (backend: ensemble), Triton's `ensemble_scheduling`.
    ensemble_scheduling: EnsembleScheduling | None = None
    # Shared objects (torch.ops.load_library) and Python files or packages (imported) that register custom
    # ops, loaded by each worker before the model; paths inside the model's folder (mpsd/config/op_libraries)
    op_libraries: list[Annotated[str, Field(min_length=1)]] = []
    # Served through OpenAI's API too (docs/openai.md)
    openai: OpenAIConfig | None = None
    # Triton's stateful sequences (mpsd/config/sequence.py)
    sequence_batching: SequenceBatching | None = None
    # Variable input dims padded to fixed sizes (an mpsd extension; mpsd/config/shape_buckets.py)
    shape_buckets: ShapeBuckets | None = None

    @field_validator("parameters", mode="before")
    @classmethod
    def _parameters_as_strings(cls, value: object) -> object:
        if isinstance(value, dict):
            return {str(k): (v if isinstance(v, str) else str(v)) for k, v in value.items()}
        return value

    @functools.cached_property
    def input_by_name(self) -> dict[str, InputConfig]:
        """Read-only by convention: built once per (frozen) config, as every request looks inputs up (an
        attribute once read: no call per request)."""
        return {t.name: t for t in self.input}

    @functools.cached_property
    def output_by_name(self) -> dict[str, OutputConfig]:
        return {t.name: t for t in self.output}
