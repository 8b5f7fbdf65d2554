"""Daemon-side placement: instance expansion, fraction ranges, the per-device budget and worker environments.

Nothing here imports torch or touches a device: "darwin" is passed as the platform to check the MPS decisions.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import pytest

from mpsd.config.model_config import ModelConfig
from mpsd.daemon.supervise.placement import (
    ENV_CUDA_VISIBLE,
    ENV_MPS_FALLBACK,
    ENV_MPS_HIGH,
    ENV_MPS_LOW,
    InstancePlacement,
    check_memory_budget,
    counts_resize_in_place,
    enforce_memory_budget,
    plan_instances,
    worker_environment,
)
from mpsd.errors import ConfigError


def config(*groups: dict[str, Any], parameters: dict[str, str] | None = None, name: str = "m") -> ModelConfig:
    tensor = {"name": "x", "data_type": "TYPE_FP32", "dims": [4]}
    raw: dict[str, Any] = {"name": name, "input": [tensor], "output": [{**tensor, "name": "y"}]}
    if groups:
        raw["instance_group"] = list(groups)
    if parameters is not None:
        raw["parameters"] = parameters
    return ModelConfig.model_validate(raw)


BASE = {"PATH": "/usr/bin", "HOME": "/var/mpsd"}


# --- expansion ---------------------------------------------------------------------------------------------


def test_default_group_is_one_auto_instance() -> None:
    plans = plan_instances(config(), platform="linux")
    assert plans == [InstancePlacement(0, 0, "KIND_AUTO", None, None, "linux")]


def test_count_is_per_listed_gpu_and_index_counts_across_groups() -> None:
    plans = plan_instances(
        config({"kind": "KIND_GPU", "count": 2, "gpus": [0, 2]}, {"kind": "KIND_CPU", "count": 1}),
        platform="linux",
    )
    assert [(p.group, p.index, p.kind, p.gpu) for p in plans] == [
        (0, 0, "KIND_GPU", 0),
        (0, 1, "KIND_GPU", 0),
        (0, 2, "KIND_GPU", 2),
        (0, 3, "KIND_GPU", 2),
        (1, 4, "KIND_CPU", None),
    ]
    assert [p.device_key for p in plans] == ["cuda:0", "cuda:0", "cuda:2", "cuda:2", "cpu"]
    assert plans[3].label("add_sub/1") == "add_sub/1#3"


def test_an_unpinned_gpu_group_is_spread_over_every_gpu_the_daemon_may_use() -> None:
    """Triton's rule: `count` instances on each GPU; KIND_AUTO stays free to fall back to the CPU."""
    cfg = config({"kind": "KIND_GPU", "count": 2}, {"kind": "KIND_AUTO"}, {"kind": "KIND_CPU"})
    plans = plan_instances(cfg, platform="linux", cuda_gpus=3)
    assert [(p.group, p.index, p.kind, p.gpu) for p in plans] == [
        (0, 0, "KIND_GPU", 0),
        (0, 1, "KIND_GPU", 0),
        (0, 2, "KIND_GPU", 1),
        (0, 3, "KIND_GPU", 1),
        (0, 4, "KIND_GPU", 2),
        (0, 5, "KIND_GPU", 2),
        (1, 6, "KIND_AUTO", 0),
        (1, 7, "KIND_AUTO", 1),
        (1, 8, "KIND_AUTO", 2),
        (2, 9, "KIND_CPU", None),
    ]
    envs = [worker_environment(p, cfg, {**BASE, ENV_CUDA_VISIBLE: "4,5,6"}, "linux") for p in plans]
    assert [e.get(ENV_CUDA_VISIBLE) for e in envs] == ["4", "4", "5", "5", "6", "6", "4", "5", "6", "4,5,6"]


@pytest.mark.parametrize(("platform", "gpus"), [("linux", 0), ("linux", 1), ("darwin", 4)])
def test_one_gpu_or_none_or_macos_keeps_one_set_of_unpinned_instances(platform: str, gpus: int) -> None:
    plans = plan_instances(config({"kind": "KIND_GPU", "count": 2}), platform=platform, cuda_gpus=gpus)
    assert [(p.kind, p.gpu) for p in plans] == [("KIND_GPU", None), ("KIND_GPU", None)]


def test_a_spread_group_is_budgeted_per_gpu() -> None:
    pinned = config({"kind": "KIND_GPU", "gpus": [1], "memory_fraction": 0.5})
    plans = {
        "spread/1": plan_instances(config({"kind": "KIND_GPU", "memory_fraction": 0.6}), "linux", 2),
        "pinned/1": plan_instances(pinned, "linux"),
    }
    (message,) = check_memory_budget(plans)
    assert message.startswith("cuda:1: memory fractions add up to 1.1") and "spread/1 (1 instance" in message


def test_a_count_change_resizes_in_place_only_where_instances_keep_their_place() -> None:
    def plans(*groups: dict[str, Any], gpus: int = 0) -> list[InstancePlacement]:
        return plan_instances(config(*groups), platform="linux", cuda_gpus=gpus)

    cpu = {"kind": "KIND_CPU"}
    one, three = plans({**cpu, "count": 1}), plans({**cpu, "count": 3})
    assert counts_resize_in_place(one, three) and counts_resize_in_place(three, one)
    # The last group grows: the instances before it keep their numbers.
    assert counts_resize_in_place(plans(cpu, cpu), plans(cpu, {**cpu, "count": 2}))
    # The first group grows: the second group's instance would become the first group's second.
    assert not counts_resize_in_place(plans(cpu, cpu), plans({**cpu, "count": 2}, cpu))
    # Spread over two GPUs: instance 1 moves from GPU 1 to GPU 0.
    gpu = {"kind": "KIND_GPU"}
    assert not counts_resize_in_place(plans(gpu, gpus=2), plans({**gpu, "count": 2}, gpus=2))
    assert not counts_resize_in_place(plans({**gpu, "count": 2}, gpus=2), plans(gpu, gpus=2))


def test_auto_with_gpus_is_pinned_gpu() -> None:
    (plan,) = plan_instances(config({"kind": "KIND_AUTO", "gpus": [1]}), platform="linux")
    assert (plan.kind, plan.gpu, plan.device_key) == ("KIND_GPU", 1, "cuda:1")


@pytest.mark.parametrize("kind", ["KIND_CPU", "KIND_MPS"])
def test_gpus_refused_with_kinds_that_do_not_use_cuda(kind: str) -> None:
    with pytest.raises(ConfigError, match=rf"instance_group\[1\]\.gpus: lists CUDA GPUs, which {kind}"):
        plan_instances(config({"kind": "KIND_CPU"}, {"kind": kind, "gpus": [0]}), platform="linux")


def test_gpus_refused_on_macos() -> None:
    with pytest.raises(ConfigError, match=r"instance_group\[0\]\.gpus: .*macOS has no CUDA"):
        plan_instances(config({"kind": "KIND_GPU", "gpus": [0]}), platform="darwin")


def test_mps_on_linux_is_left_to_the_worker_probe() -> None:
    (plan,) = plan_instances(config({"kind": "KIND_MPS"}), platform="linux")
    assert plan.device_key == "mps"


@pytest.mark.parametrize(
    ("kind", "platform", "key"),
    [
        ("KIND_GPU", "linux", "cuda:0"),
        ("KIND_AUTO", "linux", "cuda:0"),
        ("KIND_GPU", "darwin", "mps"),
        ("KIND_AUTO", "darwin", "mps"),
        ("KIND_MPS", "darwin", "mps"),
        ("KIND_CPU", "darwin", "cpu"),
    ],
)
def test_unpinned_device_keys_follow_the_platform(kind: str, platform: str, key: str) -> None:
    (plan,) = plan_instances(config({"kind": kind}), platform=platform)
    assert plan.device_key == key


# --- fraction ranges ---------------------------------------------------------------------------------------

CUDA_RANGE = "0 < memory_fraction <= 1"
MPS_RANGE = "0 <= memory_fraction <= 2"


@pytest.mark.parametrize(
    ("kind", "platform", "fraction", "expected_range"),
    [
        ("KIND_GPU", "linux", 0.0, CUDA_RANGE),
        ("KIND_GPU", "linux", 1.01, CUDA_RANGE),
        ("KIND_AUTO", "linux", 1.5, CUDA_RANGE),
        ("KIND_GPU", "darwin", 2.5, MPS_RANGE),
        ("KIND_AUTO", "darwin", -0.1, MPS_RANGE),
        ("KIND_MPS", "linux", 2.01, MPS_RANGE),
        ("KIND_GPU", "linux", math.nan, CUDA_RANGE),
    ],
)
def test_fraction_out_of_range_names_field_and_device_range(
    kind: str, platform: str, fraction: float, expected_range: str
) -> None:
    cfg = config({"kind": "KIND_CPU"}, {"kind": kind, "memory_fraction": fraction}, name="add_sub")
    with pytest.raises(ConfigError) as info:
        plan_instances(cfg, platform=platform)
    message = str(info.value)
    assert message.startswith("model 'add_sub': instance_group[1].memory_fraction: ")
    assert expected_range in message


@pytest.mark.parametrize(
    ("kind", "platform", "fraction"),
    [
        ("KIND_GPU", "linux", 1.0),
        ("KIND_GPU", "linux", 0.01),
        ("KIND_GPU", "darwin", 1.5),
        ("KIND_AUTO", "darwin", 0.0),
        ("KIND_MPS", "darwin", 2.0),
        ("KIND_MPS", "linux", 1.5),
    ],
)
def test_fraction_in_range_is_kept(kind: str, platform: str, fraction: float) -> None:
    (plan,) = plan_instances(config({"kind": kind, "memory_fraction": fraction}), platform=platform)
    assert plan.memory_fraction == fraction


def test_fraction_on_cpu_is_a_config_error() -> None:
    with pytest.raises(
        ConfigError, match=r"instance_group\[0\]\.memory_fraction: KIND_CPU has no device memory"
    ):
        plan_instances(config({"kind": "KIND_CPU", "memory_fraction": 0.5}), platform="linux")


# --- budget ------------------------------------------------------------------------------------------------


def plans_for(platform: str, **models: dict[str, Any]) -> dict[str, list[InstancePlacement]]:
    return {name: plan_instances(config(group), platform=platform) for name, group in models.items()}


def test_over_committed_gpu_names_every_model_and_the_sum() -> None:
    plans = {
        "add_sub/1": plan_instances(
            config({"kind": "KIND_GPU", "count": 2, "gpus": [0, 1], "memory_fraction": 0.3}), platform="linux"
        ),
        "resnet/3": plan_instances(config({"kind": "KIND_GPU", "memory_fraction": 0.5}), platform="linux"),
        "cpu_only/1": plan_instances(config({"kind": "KIND_CPU"}), platform="linux"),
    }
    # cuda:0 carries 2 x 0.3 from add_sub (pinned) and 0.5 from resnet (unpinned: first GPU); cuda:1 only 0.6.
    assert check_memory_budget(plans) == [
        "cuda:0: memory fractions add up to 1.1, more than 1.0: "
        "add_sub/1 (2 instances, 0.6), resnet/3 (1 instance, 0.5)"
    ]


def test_fractions_adding_up_to_one_fit_despite_float_rounding() -> None:
    # 0.2 + 0.4 + 0.3 + 0.1 is 1.0000000000000002 in floats.
    plans = {
        name: plan_instances(config({"kind": "KIND_GPU", "memory_fraction": f}), platform="linux")
        for name, f in (("a", 0.2), ("b", 0.4), ("c", 0.3), ("d", 0.1))
    }
    plans["uncapped"] = plan_instances(config({"kind": "KIND_GPU", "count": 3}), platform="linux")
    assert check_memory_budget(plans) == []
    plans["e"] = plan_instances(config({"kind": "KIND_GPU", "memory_fraction": 0.01}), platform="linux")
    assert len(check_memory_budget(plans)) == 1


def test_on_macos_gpu_auto_and_mps_share_one_device() -> None:
    plans = plans_for(
        "darwin",
        gpu={"kind": "KIND_GPU", "memory_fraction": 0.5},
        auto={"kind": "KIND_AUTO", "memory_fraction": 0.25},
        mps={"kind": "KIND_MPS", "memory_fraction": 0.5},
    )
    (message,) = check_memory_budget(plans)
    assert message.startswith("mps: memory fractions add up to 1.25, more than 1.0: ")
    for model in ("gpu (", "auto (", "mps ("):
        assert model in message


def test_mps_fraction_zero_means_no_limit_and_over_commits() -> None:
    plans = plans_for("darwin", big={"kind": "KIND_MPS", "memory_fraction": 0.0})
    assert check_memory_budget(plans) == [
        "mps: memory fractions exceed 1.0 (a fraction of 0 means no limit on MPS): "
        "big (1 instance, 0 = no limit)"
    ]


def test_budget_policy_refuse_raises_and_warn_returns() -> None:
    plans = plans_for("linux", a={"kind": "KIND_GPU", "count": 3, "memory_fraction": 0.4})
    with pytest.raises(ConfigError, match=r"memory budget exceeded .*cuda:0: .*a \(3 instances, 1\.2\)"):
        enforce_memory_budget(plans, "refuse")
    assert enforce_memory_budget(plans, "warn") == check_memory_budget(plans) != []


# --- worker environment ------------------------------------------------------------------------------------


def test_pinned_instance_sees_exactly_its_gpu() -> None:
    cfg = config({"kind": "KIND_GPU", "gpus": [0, 3]})
    plans = plan_instances(cfg, platform="linux")
    envs = [worker_environment(p, cfg, BASE, platform="linux") for p in plans]
    assert envs == [{**BASE, ENV_CUDA_VISIBLE: "0"}, {**BASE, ENV_CUDA_VISIBLE: "3"}]
    assert BASE == {"PATH": "/usr/bin", "HOME": "/var/mpsd"}


def test_gpu_index_goes_through_the_daemons_own_visible_list() -> None:
    cfg = config({"kind": "KIND_GPU", "gpus": [1, 2]})
    first, second = plan_instances(cfg, platform="linux")
    base = {**BASE, ENV_CUDA_VISIBLE: "4,5"}
    assert worker_environment(first, cfg, base, platform="linux")[ENV_CUDA_VISIBLE] == "5"
    with pytest.raises(ConfigError, match=r"instance_group\[0\]\.gpus: GPU 2 is not among the 2 GPUs"):
        worker_environment(second, cfg, base, platform="linux")


@pytest.mark.parametrize("kind", ["KIND_AUTO", "KIND_GPU", "KIND_MPS", "KIND_CPU"])
def test_unpinned_linux_environment_is_unchanged(kind: str) -> None:
    fraction = None if kind == "KIND_CPU" else 0.5
    cfg = config({"kind": kind, "memory_fraction": fraction})
    (plan,) = plan_instances(cfg, platform="linux")
    assert worker_environment(plan, cfg, BASE, platform="linux") == BASE


@pytest.mark.parametrize("kind", ["KIND_AUTO", "KIND_GPU", "KIND_MPS"])
def test_macos_fallback_defaults_on(kind: str) -> None:
    cfg = config({"kind": kind})
    (plan,) = plan_instances(cfg, platform="darwin")
    assert worker_environment(plan, cfg, BASE, platform="darwin") == {**BASE, ENV_MPS_FALLBACK: "1"}


@pytest.mark.parametrize(
    ("value", "expected"), [("false", "0"), ("False", "0"), ("true", "1"), ("TRUE", "1")]
)
def test_macos_fallback_follows_the_parameter_and_overrides_the_daemons(value: str, expected: str) -> None:
    cfg = config({"kind": "KIND_MPS"}, parameters={"mps_fallback": value})
    (plan,) = plan_instances(cfg, platform="darwin")
    env = worker_environment(plan, cfg, {**BASE, ENV_MPS_FALLBACK: "1"}, platform="darwin")
    assert env[ENV_MPS_FALLBACK] == expected


def test_bad_fallback_value_is_a_config_error() -> None:
    with pytest.raises(
        ConfigError, match=r"parameters\.mps_fallback: expected \"true\" or \"false\", got 'sometimes'"
    ):
        plan_instances(config(parameters={"mps_fallback": "sometimes"}), platform="darwin")


@pytest.mark.parametrize("key", ["intra_op_thread_count", "INTRA_OP_THREAD_COUNT"])
def test_thread_count_parameter_sets_openmp_threads_over_the_daemons(key: str) -> None:
    cfg = config({"kind": "KIND_CPU"}, parameters={key: " 3 "})
    (plan,) = plan_instances(cfg, platform="linux")
    env = worker_environment(plan, cfg, {**BASE, "OMP_NUM_THREADS": "16"}, platform="linux")
    assert env == {**BASE, "OMP_NUM_THREADS": "3"}


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5", ""])
def test_bad_thread_count_is_a_config_error(value: str) -> None:
    expected = rf"parameters\.intra_op_thread_count: expected a positive whole number, got '{value}'"
    with pytest.raises(ConfigError, match=expected):
        plan_instances(config(parameters={"intra_op_thread_count": value}), platform="linux")


def test_macos_cpu_instance_environment_is_unchanged() -> None:
    cfg = config({"kind": "KIND_CPU"})
    (plan,) = plan_instances(cfg, platform="darwin")
    assert worker_environment(plan, cfg, BASE, platform="darwin") == BASE


# docs/devices.md: HIGH = f and LOW = f * 1.4 / 1.7, written out here as numbers, not as the formula.
@pytest.mark.parametrize(
    ("fraction", "high", "low"),
    [(0.5, 0.5, 0.41176), (1.0, 1.0, 0.82353), (1.7, 1.7, 1.4), (2.0, 2.0, 1.64706), (0.01, 0.01, 0.00824)],
)
def test_macos_worker_environment_has_the_documented_watermarks(
    fraction: float, high: float, low: float
) -> None:
    cfg = config({"kind": "KIND_GPU", "memory_fraction": fraction})
    (plan,) = plan_instances(cfg, platform="darwin")
    env = worker_environment(plan, cfg, {**BASE, ENV_MPS_LOW: "1.4"}, platform="darwin")
    assert float(env[ENV_MPS_HIGH]) == high
    assert float(env[ENV_MPS_LOW]) == pytest.approx(low, abs=1e-5)
    assert float(env[ENV_MPS_LOW]) <= float(env[ENV_MPS_HIGH])  # the allocator refuses LOW above HIGH


def test_macos_fraction_zero_disables_the_limit_and_keeps_low() -> None:
    cfg = config({"kind": "KIND_MPS", "memory_fraction": 0.0})
    (plan,) = plan_instances(cfg, platform="darwin")
    base = {**BASE, ENV_MPS_LOW: "1.0"}
    env = worker_environment(plan, cfg, base, platform="darwin")
    assert env == {**base, ENV_MPS_FALLBACK: "1", ENV_MPS_HIGH: "0.0"}


def test_macos_without_fraction_leaves_watermarks_alone() -> None:
    cfg = config({"kind": "KIND_MPS"})
    (plan,) = plan_instances(cfg, platform="darwin")
    env = worker_environment(plan, cfg, BASE, platform="darwin")
    assert ENV_MPS_HIGH not in env
    assert ENV_MPS_LOW not in env


def test_platform_defaults_to_this_one() -> None:
    (plan,) = plan_instances(config())
    assert plan.platform == sys.platform


def test_a_config_copy_with_other_tensors_looks_them_up_by_their_own_names() -> None:
    """The name maps are cached per config; a copy made with `update` must not keep the original's."""
    original = config()
    assert list(original.input_by_name) == [t.name for t in original.input]  # cached now
    renamed = [t.model_copy(update={"name": "renamed"}) for t in original.input[:1]]
    copy = original.model_copy(update={"input": renamed})
    assert list(copy.input_by_name) == ["renamed"]
    assert list(original.input_by_name) != ["renamed"]
