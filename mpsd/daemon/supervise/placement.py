"""Where a model's instances run, whether their memory fractions fit, and each worker's environment.

Daemon side: torch is never imported here, so placement is decided and checked before any worker starts.
Which device actually works is decided in the worker by real probes (`mpsd.worker.device`); this module
decides what can be known from the config and the platform alone: expansion of `instance_group`, fraction
ranges, the per-device budget and the variables PyTorch reads before it starts.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from mpsd.config.model_config import ModelConfig
from mpsd.errors import ConfigError, Issue

BudgetPolicy = Literal["refuse", "warn"]

MPS_FALLBACK_PARAMETER = "mps_fallback"
# The model's CPU thread count; Triton's PyTorch backend spells it INTRA_OP_THREAD_COUNT.
THREADS_PARAMETERS = ("intra_op_thread_count", "INTRA_OP_THREAD_COUNT")
ENV_OMP_THREADS = "OMP_NUM_THREADS"
ENV_CUDA_VISIBLE = "CUDA_VISIBLE_DEVICES"
ENV_MPS_FALLBACK = "PYTORCH_ENABLE_MPS_FALLBACK"
ENV_MPS_HIGH = "PYTORCH_MPS_HIGH_WATERMARK_RATIO"
ENV_MPS_LOW = "PYTORCH_MPS_LOW_WATERMARK_RATIO"

# PyTorch's defaults on unified memory. The low (soft) watermark is kept at the same proportion of the high
# (hard) one, which also keeps low <= high: the MPS allocator refuses to start otherwise.
_MPS_DEFAULT_HIGH = 1.7
_MPS_DEFAULT_LOW = 1.4

# A sum of fractions this close to 1.0 is 1.0 (0.2 + 0.4 + 0.3 + 0.1 is 1.0000000000000002 in floats).
_BUDGET_TOLERANCE = 1e-9

_TRUE = frozenset({"true", "1"})
_FALSE = frozenset({"false", "0"})


@dataclass(frozen=True)
class InstancePlacement:
    """One worker process of a model: its group, its number within the model and where it should run.

    `index` counts instances across all groups of the model (0, 1, ...). `gpu` is an index into the GPUs the
    daemon itself may see (its own `CUDA_VISIBLE_DEVICES`, else all), None when not pinned.
    """

    group: int
    index: int
    kind: str
    gpu: int | None
    memory_fraction: float | None
    platform: str = sys.platform

    @property
    def device_type(self) -> str:
        """The device the kind prefers on this platform ("cuda", "mps" or "cpu"); the worker may still find
        it unusable, and KIND_AUTO then falls back."""
        if self.gpu is not None:
            return "cuda"
        if self.kind == "KIND_CPU":
            return "cpu"
        if self.kind == "KIND_MPS":
            return "mps"
        return "mps" if self.platform == "darwin" else "cuda"

    @property
    def device_key(self) -> str:
        """The physical device this instance draws memory from, for the budget check.

        An unpinned GPU instance uses the first GPU it sees, so it shares "cuda:0" with `gpus: [0]`; on macOS
        KIND_GPU, KIND_MPS and KIND_AUTO all share the one Apple GPU, "mps".
        """
        device_type = self.device_type
        if device_type == "cuda":
            return f"cuda:{self.gpu if self.gpu is not None else 0}"
        return device_type

    def label(self, model: str) -> str:
        """`add_sub/1#0`: the model label the caller uses, then this instance's number."""
        return f"{model}#{self.index}"


def _problem(config: ModelConfig, loc: tuple[str | int, ...], message: str) -> ConfigError:
    """The error for one field (`loc`, as pydantic locates fields), with the same problem as data."""
    field = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")
    prefix = f"model {config.name!r}: " if config.name else ""
    return ConfigError(f"{prefix}{field}: {message}", issues=(Issue("", loc, message),))


def mps_fallback(config: ModelConfig) -> bool:
    """The model's `mps_fallback` parameter: run ops MPS lacks on the CPU (default) or fail them."""
    raw = config.parameters.get(MPS_FALLBACK_PARAMETER)
    if raw is None:
        return True
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise _problem(config, ("parameters", MPS_FALLBACK_PARAMETER), f'expected "true" or "false", got {raw!r}')


def intra_op_threads(config: ModelConfig) -> int | None:
    """The model's `intra_op_thread_count` parameter: how many threads torch runs each operator on."""
    for key in THREADS_PARAMETERS:
        raw = config.parameters.get(key)
        if raw is None:
            continue
        value = raw.strip()
        if not (value.isascii() and value.isdigit()) or int(value) < 1:
            raise _problem(config, ("parameters", key), f"expected a positive whole number, got {raw!r}")
        return int(value)
    return None


def _check_fraction(config: ModelConfig, group: int, placement: InstancePlacement) -> None:
    """Refuse a fraction that the device's `set_per_process_memory_fraction` would refuse; name the range."""
    fraction = placement.memory_fraction
    if fraction is None:
        return
    field = ("instance_group", group, "memory_fraction")
    device_type = placement.device_type
    where = f"{placement.kind} on {placement.platform} uses {device_type.upper()}"
    if device_type == "cpu":
        raise _problem(
            config,
            field,
            "KIND_CPU has no device memory to divide; remove memory_fraction "
            "(max_rss_bytes caps a worker's memory instead)",
        )
    if device_type == "cuda" and not 0.0 < fraction <= 1.0:
        raise _problem(
            config,
            field,
            f"{fraction} is out of range: {where}, which allows 0 < memory_fraction <= 1 "
            "(a share of the GPU's total memory)",
        )
    if device_type == "mps" and not 0.0 <= fraction <= 2.0:
        raise _problem(
            config,
            field,
            f"{fraction} is out of range: {where}, which allows 0 <= memory_fraction <= 2 "
            "(a multiple of Metal's recommended working set; 0 means no limit)",
        )


def _spread(kind: str, platform: str, cuda_gpus: int) -> list[int | None]:
    """The GPUs an unpinned group goes to: `count` instances on each of several CUDA GPUs (Triton's rule
    for KIND_GPU, and for KIND_AUTO, which means the GPU where there is one); else [None], one set of
    instances on the first GPU the worker finds (or the CPU, for KIND_AUTO without a usable GPU)."""
    if platform == "darwin" or kind not in ("KIND_GPU", "KIND_AUTO") or cuda_gpus < 2:
        return [None]
    return list(range(cuda_gpus))


def plan_instances(
    config: ModelConfig, platform: str = sys.platform, cuda_gpus: int = 0
) -> list[InstancePlacement]:
    """Expand `instance_group` into one placement per worker: `count` instances, or `count` per GPU.

    The GPUs are the listed `gpus`, else, for KIND_GPU and KIND_AUTO off macOS, each of the `cuda_gpus`
    the daemon may use when there are several. KIND_AUTO with `gpus` becomes KIND_GPU (pinning means CUDA;
    falling back to CPU would defeat it); spread over every GPU it stays KIND_AUTO, free to fall back.
    `gpus` is refused on macOS, where KIND_GPU means MPS and CUDA does not exist, and with KIND_CPU or
    KIND_MPS. KIND_MPS on Linux is not refused here: the worker's probe fails the load with the reason.
    """
    mps_fallback(config)
    intra_op_threads(config)
    plans: list[InstancePlacement] = []
    for g, group in enumerate(config.instance_group):
        kind = group.kind
        if group.gpus is not None:
            if kind in ("KIND_CPU", "KIND_MPS"):
                raise _problem(
                    config,
                    ("instance_group", g, "gpus"),
                    f"lists CUDA GPUs, which {kind} does not use; remove gpus or use KIND_GPU",
                )
            if platform == "darwin":
                raise _problem(
                    config,
                    ("instance_group", g, "gpus"),
                    "lists CUDA GPUs, but macOS has no CUDA; remove gpus (KIND_GPU uses MPS there)",
                )
            kind = "KIND_GPU"
        gpus: list[int | None] = (
            list(group.gpus) if group.gpus is not None else _spread(kind, platform, cuda_gpus)
        )
        first = len(plans)
        for gpu in gpus:
            for _ in range(group.count):
                plans.append(
                    InstancePlacement(
                        group=g,
                        index=len(plans),
                        kind=kind,
                        gpu=gpu,
                        memory_fraction=group.memory_fraction,
                        platform=platform,
                    )
                )
        _check_fraction(config, g, plans[first])
    return plans


def instance_places(plans: Sequence[InstancePlacement]) -> list[tuple[int, int | None, int]]:
    """Where each instance runs, as (group, GPU, its number among the group's instances on that GPU)."""
    seen: dict[tuple[int, int | None], int] = {}
    places = []
    for plan in plans:
        key = (plan.group, plan.gpu)
        places.append((*key, seen.get(key, 0)))
        seen[key] = seen.get(key, 0) + 1
    return places


def counts_resize_in_place(old: Sequence[InstancePlacement], new: Sequence[InstancePlacement]) -> bool:
    """Whether a count-only change can keep the running instances by number and add or remove the last.

    Instance numbers run across groups and GPUs, so a count change renumbers every instance after the group
    or GPU it changes: with `{count: 1}` on two GPUs, instance 1 is on GPU 1; with `{count: 2}` it is the
    second on GPU 0. Kept by number, it would run in the wrong place. In place only when the instances both
    plans have are where they were; otherwise the version is replaced as a whole, side by side.
    """
    shared = min(len(old), len(new))
    return instance_places(old)[:shared] == instance_places(new)[:shared]


def _describe(total: float) -> str:
    return "0 = no limit" if math.isinf(total) else f"{round(total, 6):g}"


def check_memory_budget(plans: Mapping[str, Sequence[InstancePlacement]]) -> list[str]:
    """One message per device whose instances' fractions add up to more than 1.0, naming every model on it.

    `plans` is keyed by model label (e.g. "add_sub/1"). Instances without a fraction are not counted: they
    are uncapped by choice. A fraction of 0 on MPS means no limit, so it over-commits the device by itself.
    """
    shares: dict[str, dict[str, list[float]]] = {}
    for model, placements in plans.items():
        for p in placements:
            if p.memory_fraction is None or p.device_type == "cpu":
                continue
            share = math.inf if p.device_type == "mps" and p.memory_fraction == 0.0 else p.memory_fraction
            shares.setdefault(p.device_key, {}).setdefault(model, []).append(share)
    messages: list[str] = []
    for key in sorted(shares):
        by_model = shares[key]
        total = sum(sum(s) for s in by_model.values())
        if total <= 1.0 + _BUDGET_TOLERANCE:
            continue
        parts = []
        for model, model_shares in by_model.items():
            count = len(model_shares)
            noun = "instance" if count == 1 else "instances"
            parts.append(f"{model} ({count} {noun}, {_describe(sum(model_shares))})")
        summary = (
            "memory fractions exceed 1.0 (a fraction of 0 means no limit on MPS)"
            if math.isinf(total)
            else f"memory fractions add up to {_describe(total)}, more than 1.0"
        )
        messages.append(f"{key}: {summary}: {', '.join(parts)}")
    return messages


def enforce_memory_budget(
    plans: Mapping[str, Sequence[InstancePlacement]], policy: BudgetPolicy
) -> list[str]:
    """Apply the budget policy: "refuse" raises ConfigError listing every over-committed device; "warn"
    returns the messages for the caller to log and starts the workers anyway."""
    messages = check_memory_budget(plans)
    if messages and policy == "refuse":
        raise ConfigError("memory budget exceeded (policy refuse): " + "; ".join(messages))
    return messages


def _visible_gpu(group: int, gpu: int, base: Mapping[str, str]) -> str:
    """The `CUDA_VISIBLE_DEVICES` entry for a pinned instance, read through the daemon's own restriction."""
    visible = base.get(ENV_CUDA_VISIBLE)
    if visible is None:
        return str(gpu)
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if gpu >= len(entries):
        raise ConfigError(
            f"instance_group[{group}].gpus: GPU {gpu} is not among the {len(entries)} "
            f"GPUs the daemon may use ({ENV_CUDA_VISIBLE}={visible!r})"
        )
    return entries[gpu]


def worker_environment(
    placement: InstancePlacement,
    config: ModelConfig,
    base: Mapping[str, str],
    platform: str = sys.platform,
) -> dict[str, str]:
    """A copy of `base` with what PyTorch must read before it starts in this worker; nothing else changes.

    - `intra_op_thread_count` (or Triton's `INTRA_OP_THREAD_COUNT`) in the model's parameters:
      `OMP_NUM_THREADS`, torch's CPU thread count (it wins over the daemon's own environment);
    - pinned GPU: `CUDA_VISIBLE_DEVICES` names that one GPU (the worker then uses cuda:0);
    - on macOS, for a kind that may resolve to MPS: `PYTORCH_ENABLE_MPS_FALLBACK` is "1" or "0" from the
      model's `mps_fallback` parameter (read at `import torch`), and with a fraction f the watermarks are
      HIGH = f and LOW = f * 1.4 / 1.7 (PyTorch's default proportion), because the allocator refuses to start
      when LOW > HIGH and the default LOW is 1.4. With f = 0 (no hard limit) any LOW up to 2 is valid, so
      LOW is left as it is.
    """
    env = dict(base)
    threads = intra_op_threads(config)
    if threads is not None:  # read by OpenMP as torch starts: the thread team has this size from the start
        env[ENV_OMP_THREADS] = str(threads)
    if placement.gpu is not None:
        env[ENV_CUDA_VISIBLE] = _visible_gpu(placement.group, placement.gpu, base)
    may_use_mps = placement.gpu is None and placement.kind in ("KIND_AUTO", "KIND_GPU", "KIND_MPS")
    if platform == "darwin" and may_use_mps:
        env[ENV_MPS_FALLBACK] = "1" if mps_fallback(config) else "0"
        fraction = placement.memory_fraction
        if fraction is not None:
            env[ENV_MPS_HIGH] = repr(float(fraction))
            if fraction > 0.0:
                env[ENV_MPS_LOW] = repr(float(fraction) * _MPS_DEFAULT_LOW / _MPS_DEFAULT_HIGH)
    return env
