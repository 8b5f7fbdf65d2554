"""A model's config: the schema of its `config.yaml` (`model_schema.py`) validated by the rules across its
fields (`model_rules.py`), and what follows from it (the batch sizes compiled and recorded at, the model's
file name and platform).

Every other module takes `ModelConfig` from here, and the schema's names too (re-exported below).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import model_validator

from mpsd.config.model_rules import check, error_loc
from mpsd.config.model_schema import (
    Backend,
    DataType,
    DynamicBatching,
    InputConfig,
    InstanceGroup,
    Kind,
    ModelFields,
    ModelWarmup,
    OpenAIConfig,
    Optimization,
    OutputConfig,
    QueuePolicy,
    ResidencyConfig,
    ResponseCacheConfig,
    TensorConfig,
    TransactionPolicy,
    VersionPolicy,
    WarmupInput,
)

__all__ = [
    "DEFAULT_FILENAMES",
    "Backend",
    "DataType",
    "DynamicBatching",
    "InputConfig",
    "InstanceGroup",
    "Kind",
    "ModelConfig",
    "ModelWarmup",
    "OpenAIConfig",
    "Optimization",
    "OutputConfig",
    "QueuePolicy",
    "ResidencyConfig",
    "ResponseCacheConfig",
    "TensorConfig",
    "TransactionPolicy",
    "VersionPolicy",
    "WarmupInput",
    "error_loc",
]

DEFAULT_FILENAMES: dict[str, str] = {
    "torchscript": "model.pt",
    "torch_export": "model.pt2",
    # AOTInductor packages are .pt2 files too: a distinct default name keeps a version folder that holds
    # both (the exported program and its compiled package) unambiguous.
    "aoti": "model.aoti.pt2",
    "python": "model.py",
    "ensemble": "",  # no file: its steps' models run its requests
}
PLATFORMS: dict[str, str] = {
    "torchscript": "pytorch_libtorch",
    "torch_export": "torch_export",
    "aoti": "torch_aoti",  # Triton has no AOTInductor backend: mpsd's own name, as torch_export is
    "python": "python",
    "ensemble": "ensemble",
}
# Default CUDA graph sizes are multiples of a step at least this large (see cuda_graph_batch_sizes).
GRAPH_STEP_MIN = 8


class ModelConfig(ModelFields):
    """A model's configuration as read from `<repo>/<model>/config.yaml` (or mapped from `config.pbtxt`)."""

    @model_validator(mode="after")
    def _rules(self) -> ModelConfig:
        check(self)
        return self

    def compile_batch_sizes(self) -> tuple[int, ...]:
        """The batch sizes warm-up compiles at under optimization.compile, ascending; () when off or for a
        model without batching (its one warm-up request compiles it).

        1, max_batch_size and the preferred batch sizes: with torch's default (or `dynamic: true`) a second
        size makes the batch dimension dynamic, so one graph then serves every size up to max_batch_size;
        with `dynamic: false` other sizes compile on their first request.
        """
        if self.optimization.compile is None or self.max_batch_size == 0:
            return ()
        preferred = self.dynamic_batching.preferred_batch_size if self.dynamic_batching else []
        return tuple(sorted({1, self.max_batch_size, *(p for p in preferred if p <= self.max_batch_size)}))

    def cuda_graph_batch_sizes(self) -> tuple[int, ...]:
        """The batch sizes to record CUDA graphs at, ascending; () when graphs are off.

        Without a `graph_spec`: the preferred batch sizes, max_batch_size, the powers of two below a step
        of max(8, max_batch_size / 16 rounded up to a power of two), and every multiple of that step. A
        batch then pads by fewer than `step` samples (padding to powers of two cost up to half of a large
        batch's compute) with at most about twenty graphs, which share one memory pool.
        """
        cuda = self.optimization.cuda
        if not cuda.graphs:
            return ()
        if cuda.graph_spec:
            return tuple(sorted({g.batch_size for g in cuda.graph_spec}))
        preferred = self.dynamic_batching.preferred_batch_size if self.dynamic_batching else []
        top = self.max_batch_size
        step = max(GRAPH_STEP_MIN, (1 << (top - 1).bit_length()) // 16)
        small = [1 << i for i in range(step.bit_length() - 1)]
        sizes = {*preferred, *small, *range(step, top + 1, step), top}
        return tuple(sorted(s for s in sizes if s <= self.max_batch_size))

    @property
    def model_filename(self) -> str:
        return self.default_model_filename or DEFAULT_FILENAMES[self.backend]

    @property
    def platform(self) -> str:
        return PLATFORMS[self.backend]

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> ModelConfig:
        """A copy without the cached name maps, which `update` may have made wrong."""
        copy = super().model_copy(update=update, deep=deep)
        for cached in ("input_by_name", "output_by_name"):
            copy.__dict__.pop(cached, None)
        return copy
