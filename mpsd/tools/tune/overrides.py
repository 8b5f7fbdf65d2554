"""A trial's settings as the `config` parameter of a load: only the fields the tuner changes, taken from
the config the model serves (the daemon completes the rest from the repository, as Triton does), so a
setting the tuner does not search (queue policies, priorities, autocast) stays as it is."""

from __future__ import annotations

import copy
from typing import Any

from mpsd.tools.tune.trials import Settings


def batching(served: dict[str, Any]) -> bool:
    return int(served.get("max_batch_size", 0)) > 0


def groups(served: dict[str, Any]) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = served.get("instance_group") or [{}]
    return found


def start_settings(served: dict[str, Any]) -> Settings:
    """The settings the model serves with now: trial 0."""
    db = served.get("dynamic_batching") or {}
    graphs = bool(served.get("optimization", {}).get("cuda", {}).get("graphs", False))
    return Settings(
        instances=sum(int(g.get("count", 1)) for g in groups(served)),
        max_batch_size=int(served.get("max_batch_size", 0)),
        delay_us=int(db.get("max_queue_delay_microseconds", 0)) if batching(served) else 0,
        preferred=tuple(int(p) for p in db.get("preferred_batch_size", [])) if batching(served) else (),
        cuda_graphs=graphs,
    )


def override(served: dict[str, Any], settings: Settings, cuda_graphs: bool) -> dict[str, Any]:
    """The load's `config`: the instance count (of the model's one instance group), the batch size, delay
    and preferred sizes (dynamic batching is turned on), and with `cuda_graphs` the optimization."""
    out: dict[str, Any] = {}
    found = copy.deepcopy(groups(served))
    found[0]["count"] = settings.instances
    out["instance_group"] = found
    if batching(served):
        out["max_batch_size"] = settings.max_batch_size
        db = copy.deepcopy(served.get("dynamic_batching") or {})
        db["max_queue_delay_microseconds"] = settings.delay_us
        db.pop("preferred_batch_size", None)
        if settings.preferred:
            db["preferred_batch_size"] = list(settings.preferred)
        out["dynamic_batching"] = db
    if cuda_graphs:
        optimization = copy.deepcopy(served.get("optimization") or {})
        cuda = optimization.setdefault("cuda", {})
        cuda["graphs"] = settings.cuda_graphs
        if not settings.cuda_graphs or settings.max_batch_size != served.get("max_batch_size"):
            cuda.pop("graph_spec", None)  # recorded sizes of another batch size: the defaults instead
        out["optimization"] = optimization
        if "parameters" in served:  # mpsd's own optimization settings travel as parameters
            out["parameters"] = served["parameters"]
    return out
