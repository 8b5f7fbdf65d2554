"""The Grafana dashboard in deploy/grafana/ against a live daemon: every metric and every label its PromQL
queries (and its legends and variables) name exists on the daemon's `/metrics` after some requests, a
failure, a load on demand and an unload; the provisioning files are shaped as Grafana reads them.

A CPU-only host has no device time and no GPU memory: those families are declared on `/metrics` but have
no samples, so there the test checks their names only (on a CUDA host a model runs on the GPU and they
are checked in full). The labels Prometheus adds when it scrapes (`instance`, `job`) are not on `/metrics`.
"""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import yaml
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from tests import models
from tests.conftest import ROOT, RunningDaemon, free_port, serving, wait_for

GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD = json.loads((GRAFANA / "dashboards" / "mpsd.json").read_text())
TARGET_LABELS = frozenset({"instance", "job"})  # added by Prometheus to every series it scrapes
GPU_ONLY = frozenset(
    {
        "mpsd_inference_device_compute_seconds",
        "mpsd_gpu_memory_used_bytes",
        "mpsd_gpu_memory_allocated_bytes",
        "mpsd_gpu_memory_total_bytes",
    }
)
GPU = torch.cuda.is_available()

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_METRIC = re.compile(r"\bmpsd_[A-Za-z0-9_]+")
_MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_LEGEND = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
_LABEL_VALUES = re.compile(r"label_values\(\s*(?:[^,]*?),\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)")


def queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(PromQL, legend format) of every panel target and every query variable."""
    found = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            found.append((target["expr"], target.get("legendFormat", "")))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            found.append((variable["query"]["query"], ""))
    return found


def names_in(expr: str, legend: str) -> tuple[set[str], set[str]]:
    """The metric names and the label names one query uses: in its selectors, groupings, label_values and
    legend."""
    labels = set(_LABEL_VALUES.findall(expr)) | set(_LEGEND.findall(legend))
    bare = _STRING.sub('""', expr)  # "$model" and regexes are values, not names
    metrics = set(_METRIC.findall(bare))
    for selector in re.findall(r"\{([^}]*)\}", bare):
        labels |= set(_MATCHER.findall(selector))
    for grouping in _GROUPING.findall(bare):
        labels |= {name.strip() for name in grouping.split(",") if name.strip()}
    return metrics, labels


def test_the_query_parser_finds_names_in_promql() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (model, le) (rate(mpsd_x_bucket{model=~"$model", a!="b{c=d}"}[5m])))'
        " / on(model) group_left(device) mpsd_y"
    )
    assert names_in(expr, "{{model}} {{ reason }}") == (
        {"mpsd_x_bucket", "mpsd_y"},
        {"model", "le", "a", "device", "reason"},
    )
    assert names_in('label_values(mpsd_z{instance=~"$i"}, model)', "") == ({"mpsd_z"}, {"instance", "model"})


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    tmp = tmp_path_factory.mktemp("grafana")
    repo = tmp / "repo"
    kind = "KIND_GPU" if GPU else "KIND_CPU"
    models.add_sub(repo, dims=4, instance_group=[{"kind": kind, "count": 1}])
    models.python_model(
        repo,
        "raiser",
        "if float(inputs['x'].sum()) > 0:\n    raise ValueError('no')\nreturn {'y': inputs['x']}",
        instance_group=[{"kind": "KIND_CPU", "count": 1}],
    )
    models.python_model(
        repo,
        "lazy",
        "return {'y': inputs['x']}",
        instance_group=[{"kind": "KIND_CPU", "count": 1}],
        residency={"load": "on_demand", "keep_alive_s": 1},
    )
    metrics = f"127.0.0.1:{free_port()}"
    config = tmp / "mpsd.yaml"
    config.write_text(yaml.safe_dump({"metrics_address": metrics}))
    with serving(repo, tmp / "daemon.log", config=config) as running:
        running.metrics = metrics  # type: ignore[attr-defined]
        yield running


def scrape(daemon: RunningDaemon) -> str:
    with urllib.request.urlopen(f"http://{daemon.metrics}/metrics", timeout=10) as response:  # type: ignore[attr-defined]
        return response.read().decode()


def xy(name: str, n: int) -> grpcclient.InferInput:
    inp = grpcclient.InferInput(name, [n], "FP32")
    inp.set_data_from_numpy(np.ones(n, np.float32))
    return inp


def test_every_metric_and_label_the_dashboard_queries_is_on_a_live_daemons_metrics(
    daemon: RunningDaemon,
) -> None:
    for _ in range(5):
        inputs = []
        for name in ("INPUT0", "INPUT1"):
            inp = grpcclient.InferInput(name, [2, 4], "FP32")
            inp.set_data_from_numpy(np.ones((2, 4), np.float32))
            inputs.append(inp)
        daemon.client.infer("add_sub", inputs)
    with pytest.raises(InferenceServerException):
        daemon.client.infer("raiser", [xy("x", 2)])
    daemon.client.infer("lazy", [xy("x", 2)])  # a load on demand, then an unload after its keep-alive
    wait_for(lambda: 'mpsd_model_unloads_total{model="lazy"' in scrape(daemon), 30, "lazy unloaded")

    text = scrape(daemon)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    labels_of: dict[str, set[str]] = {}  # every sample name on /metrics, and the labels it has
    for family in families.values():
        for sample in family.samples:
            labels_of.setdefault(sample.name, set()).update(sample.labels)
    declared = {
        f"{name}{suffix}" for name in families for suffix in ("", "_total", "_bucket", "_sum", "_count")
    }

    checked: set[str] = set()
    problems = []
    for expr, legend in queries(DASHBOARD):
        metrics, labels = names_in(expr, legend)
        assert metrics, f"no mpsd metric in {expr!r}"
        for metric in metrics:
            family = next((f for f in GPU_ONLY if metric.startswith(f)), None)
            if metric not in labels_of:
                if family is not None and not GPU and metric in declared:
                    continue  # declared here; samples only where a device reports them
                problems.append(f"{metric}: not on /metrics (in {expr})")
                continue
            missing = labels - TARGET_LABELS - labels_of[metric]
            if missing:
                problems.append(f"{metric}: no label {sorted(missing)} (in {expr})")
            checked.add(metric)
    assert problems == []
    # What the dashboard is for: each of these is queried, and was checked against real samples.
    for metric in (
        "mpsd_inference_request_success_total",
        "mpsd_inference_request_failure_total",
        "mpsd_inference_request_duration_seconds_bucket",
        "mpsd_inference_pending_request_count",
        "mpsd_inference_batch_executions_total",
        "mpsd_memory_budget_bytes",
        "mpsd_memory_resident_bytes",
        "mpsd_worker_rss_bytes",
        "mpsd_model_resident",
        "mpsd_model_loads_on_demand_total",
        "mpsd_model_unloads_total",
        "mpsd_model_load_wait_seconds_sum",
        "mpsd_worker_restarts_total",
    ):
        assert metric in checked, metric


def test_the_dashboard_is_one_grafana_can_provision() -> None:
    """Unique panel ids, panels that do not overlap on Grafana's 24-column grid, every query on the
    dashboard's Prometheus data source variable; provider and data source files in Grafana's format."""
    panels = DASHBOARD["panels"]
    assert DASHBOARD["uid"] == "mpsd" and isinstance(DASHBOARD["schemaVersion"], int)
    assert len({p["id"] for p in panels}) == len(panels)
    cells: set[tuple[int, int]] = set()
    for p in panels:
        grid = p["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, p["title"]
        mine = {(grid["x"] + dx, grid["y"] + dy) for dx in range(grid["w"]) for dy in range(grid["h"])}
        assert not mine & cells, f"{p['title']} overlaps another panel"
        cells |= mine
        for target in p.get("targets", []):
            assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
    variables = {v["name"]: v for v in DASHBOARD["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    )

    provider = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "mpsd.yaml").read_text())
    assert provider["apiVersion"] == 1
    (entry,) = provider["providers"]
    assert entry["type"] == "file" and Path(entry["options"]["path"]).is_absolute()
    source = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    assert source["apiVersion"] == 1
    (prometheus,) = source["datasources"]
    assert prometheus["type"] == "prometheus" and prometheus["url"].startswith("http")
    scrape_config = yaml.safe_load((GRAFANA / "prometheus.yml").read_text())
    (job,) = scrape_config["scrape_configs"]
    assert not job.get("honor_labels", False)  # `instance` is the daemon's address, as the dashboard expects
