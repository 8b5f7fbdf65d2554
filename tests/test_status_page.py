"""The status page on a real daemon's HTTP port: its files and JSON document, the token it asks for, and the
page itself in headless Chromium (the system's, driven by Selenium through chromedriver), which shows a model
that loads on demand going from not loaded to loaded after a request and back after its keep-alive.

The daemon wants a token for `logs-statistics` only (the page's data), so the stock clients infer without
one. The browser test skips where no Chromium and chromedriver are installed, saying how this system's
package manager installs them. MPSD_UPDATE_SCREENSHOT=1 writes the page's screenshot to docs/status-page.png.
"""

from __future__ import annotations

import fnmatch
import http.client
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml

from mpsd.daemon.api.recent import RecentActivity, quantile
from mpsd.daemon.dataplane.stats import LATENCY_BUCKETS_S, VersionStats
from tests import models
from tests.conftest import ROOT, RunningDaemon, free_port, http_request, serving
from tests.manual_clock import Clock
from tests.os_skips import not_installed

MIB = 2**20
TOKEN = "status-page-reader"
OTHER_TOKEN = "status-page-inference-only"
KEEP_ALIVE_S = 3
SCREENSHOT = ROOT / "docs" / "status-page.png"
PACKAGE = ROOT / "mpsd" / "daemon" / "api" / "http" / "status"


def python_model(
    repo: Path, name: str, body: str = "return {'y': inputs['x'] + 1}", **residency: Any
) -> None:
    models.python_model(
        repo,
        name,
        body,
        config={
            "backend": "python",
            "max_batch_size": 0,
            "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [-1]}],
            "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [-1]}],
            "instance_group": [{"kind": "KIND_CPU"}],
            "residency": residency,
        },
    )


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    tmp = tmp_path_factory.mktemp("status")
    repo = tmp / "repo"
    models.add_sub(repo, dims=4, instance_group=[{"kind": "KIND_CPU", "count": 1}])
    python_model(repo, "embed", footprint_bytes=300 * MIB, pinned=True)
    python_model(repo, "lazy", load="on_demand", keep_alive_s=KEEP_ALIVE_S, footprint_bytes=400 * MIB)
    python_model(repo, "big", load="on_demand", footprint_bytes=1024 * MIB)
    models.python_model(repo, "auto", "return {'y': inputs['x']}")  # no instance_group: KIND_AUTO
    for name, token in (("reader.token", TOKEN), ("other.token", OTHER_TOKEN)):
        (tmp / name).write_text(token)
        (tmp / name).chmod(0o600)
    config = tmp / "mpsd.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "memory_budget_bytes": {"cpu": 2048 * MIB},
                "metrics_address": f"127.0.0.1:{free_port()}",
                "auth": {
                    "open_categories": ["inference", "health", "model-repository"],
                    "tokens": [
                        {"token_file": "reader.token", "categories": ["logs-statistics"]},
                        {"token_file": "other.token", "categories": ["inference"]},
                    ],
                },
            }
        )
    )
    with serving(repo, tmp / "daemon.log", config=config) as running:
        yield running


def infer_add_sub(daemon: RunningDaemon, times: int) -> float:
    """`times` requests one after another; the slowest round trip, in ms."""
    slowest = 0.0
    for _ in range(times):
        inputs = []
        for name in ("INPUT0", "INPUT1"):
            inp = grpcclient.InferInput(name, [1, 4], "FP32")
            inp.set_data_from_numpy(np.ones((1, 4), np.float32))
            inputs.append(inp)
        start = time.perf_counter()
        daemon.client.infer("add_sub", inputs)
        slowest = max(slowest, (time.perf_counter() - start) * 1e3)
    return slowest


def infer_lazy(daemon: RunningDaemon) -> None:
    inp = grpcclient.InferInput("x", [2], "FP32")
    inp.set_data_from_numpy(np.ones(2, np.float32))
    assert daemon.client.infer("lazy", [inp]).as_numpy("y").tolist() == [2.0, 2.0]


def document(daemon: RunningDaemon, token: str | None = TOKEN) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    status, body, _ = http_request(daemon.http_address, "GET", "/status/status.json", headers=headers)
    return status, body


def by_name(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["name"]: m for m in doc["models"]}


# ---- files, access and the document ---------------------------------------------------------------------


def get(daemon: RunningDaemon, path: str) -> tuple[int, Any, bytes]:
    """(status, headers, body) of a GET without a token."""
    host, _, port = daemon.http_address.rpartition(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.headers, response.read()
    finally:
        connection.close()


def test_the_page_and_its_files_are_served_from_the_package_without_a_token(daemon: RunningDaemon) -> None:
    status, headers, _ = get(daemon, "/status")
    assert (status, headers["Location"]) == (302, "/status/")  # where the page's relative links resolve
    files = {"": "text/html", "status.js": "text/javascript", "status.css": "text/css"}
    for name, kind in {**files, "favicon.svg": "image/svg+xml"}.items():
        status, headers, body = get(daemon, f"/status/{name}")
        assert status == 200 and headers["Content-Type"].startswith(kind), name
        assert headers["Content-Security-Policy"] == "default-src 'self'; frame-ancestors 'none'"
        assert body == (PACKAGE / (name or "index.html")).read_bytes()
        urls = set(re.findall(rb"https?://[^\s\"')]+", body))
        assert urls <= {b"http://www.w3.org/2000/svg"}, (name, urls)  # nothing from elsewhere
    assert get(daemon, "/status/other.js")[0] == 404


def test_every_file_of_the_page_is_installed_as_package_data() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = patterns["mpsd.daemon.api.http.status"]
    files = [p.name for p in PACKAGE.iterdir() if p.is_file() and p.suffix != ".py"]
    assert sorted(files) == ["favicon.svg", "index.html", "status.css", "status.js"]
    assert all(any(fnmatch.fnmatch(name, pattern) for pattern in shipped) for name in files), shipped


def test_the_document_has_the_access_category_of_list_workers(daemon: RunningDaemon) -> None:
    status, body = document(daemon, token=None)
    assert status == 401 and "category 'logs-statistics'" in body["error"], body
    status, body = document(daemon, token=OTHER_TOKEN)
    assert status == 403 and "needs category 'logs-statistics'" in body["error"], body
    status, _ = document(daemon)
    assert status == 200


def test_the_document_shows_models_residency_budget_and_recent_requests(daemon: RunningDaemon) -> None:
    slowest_ms = infer_add_sub(daemon, 20)
    status, doc = document(daemon)
    assert status == 200
    models_ = by_name(doc)
    assert sorted(models_) == ["add_sub", "auto", "big", "embed", "lazy"]
    add_sub = models_["add_sub"]
    assert add_sub["state"] == "READY" and add_sub["residency"]["resident"] is True
    (instance,) = add_sub["instances"]
    assert instance["device"] == "cpu" and instance["state"] == "ready" and instance["pid"] > 0
    requests = add_sub["requests"]
    assert requests["per_s"] > 0 and requests["failures_per_s"] == 0
    assert 0 < requests["p50_ms"] <= requests["p99_ms"]
    assert requests["p50_ms"] < slowest_ms  # the daemon's part of a round trip the client timed
    big = models_["big"]
    assert big["state"] == "UNAVAILABLE" and big["reason"] == "not loaded yet: loads on its first request"
    assert big["residency"] == {
        "resident": False,
        "load": "on_demand",
        "keep_alive": "never",
        "pinned": False,
        "idle_s": None,
        "loaded_s": None,
    }
    assert big["footprint"] == {"cpu": 1024 * MIB} and big["instances"] == []
    auto = models_["auto"]  # KIND_AUTO on a host without a usable GPU: on the CPU, and counted there
    assert [i["device"] for i in auto["instances"]] == ["cpu"] and list(auto["footprint"]) == ["cpu"], auto
    assert doc["window_s"] == 300
    assert models_["embed"]["residency"]["pinned"] is True
    (cpu,) = doc["devices"]
    assert cpu["device"] == "cpu" and cpu["budget_bytes"] == 2048 * MIB
    assert cpu["models"]["embed"] == 300 * MIB and "big" not in cpu["models"]
    assert cpu["resident_bytes"] >= sum(cpu["models"].values())
    assert any(e["message"] == "model version ready" and e["model"] == "add_sub" for e in doc["events"])


# ---- the page in a browser --------------------------------------------------------------------------------


def _browser() -> Any:
    """Headless Chromium through chromedriver, both from the system; skips where either is missing."""
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    binary = next((p for p in map(shutil.which, ("chromium", "chromium-browser")) if p), None)
    driver = shutil.which("chromedriver")
    if binary is None or driver is None:
        pytest.skip(not_installed("chromium and chromedriver"))
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1360,900"):
        options.add_argument(arg)
    return webdriver.Chrome(options=options, service=Service(driver))


def test_the_page_shows_a_model_load_on_demand_and_unload_after_its_keep_alive(
    daemon: RunningDaemon, tmp_path: Path
) -> None:
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ready
    from selenium.webdriver.support.wait import WebDriverWait

    browser = _browser()
    try:
        # The page redraws its tables on each refresh: an element found before a redraw is stale after it,
        # so each read finds its element again until one read holds.
        wait = WebDriverWait(
            browser, 30, poll_frequency=0.1, ignored_exceptions=(StaleElementReferenceException,)
        )

        def text(css: str, parent: bool = False) -> str:
            def read(_: Any) -> str:
                found = browser.find_element(By.CSS_SELECTOR, css)
                return str((found.find_element(By.XPATH, "..") if parent else found).text)

            return str(wait.until(read))

        def row(model: str, resident: bool) -> str:
            return text(f'tr[data-model="{model}"][data-resident="{str(resident).lower()}"]')

        browser.get(f"http://{daemon.http_address}/status")
        token = wait.until(ready.visibility_of_element_located((By.ID, "token")))  # the data needs one
        token.send_keys(TOKEN)
        browser.find_element(By.CSS_SELECTOR, "#token-form button").click()
        lazy = row("lazy", resident=False)
        names = browser.execute_script(  # in one read: a redraw may come between two
            "return [...document.querySelectorAll('#models tbody tr')].map(r => r.dataset.model);"
        )
        assert names == ["add_sub", "auto", "big", "embed", "lazy"]
        assert "not loaded yet: loads on its first request" in lazy
        auto = text('tr[data-model="auto"]')
        assert "1/1 ready on cpu" in auto and "cpu: " in auto and "cuda" not in auto, auto
        caption = text("#window", parent=True)
        assert re.fullmatch(r"Requests over the last \d+ (s|min \d+ s); p50 .*", caption, re.S), caption
        # With no model's figures (a repository without models, or no reading kept yet) the caption says
        # the window's length: the page's own drawing, given such a document's models.
        drawn = browser.execute_script(
            "drawModels([], {}, [], 300); return document.getElementById('window').textContent;"
        )
        assert drawn == "5 min 0 s", drawn

        infer_add_sub(daemon, 30)
        infer_lazy(daemon)
        lazy = row("lazy", resident=True)
        assert "loaded" in lazy and "ready" in lazy and "1/1 ready on cpu" in lazy
        wait.until(
            lambda _: browser.find_element(By.CSS_SELECTOR, '#devices [data-device="cpu"]').text.count("lazy")
        )
        browser.save_screenshot(str(tmp_path / "status-page.png"))
        if os.environ.get("MPSD_UPDATE_SCREENSHOT") == "1":
            shutil.copyfile(tmp_path / "status-page.png", SCREENSHOT)

        lazy = row("lazy", resident=False)  # after its keep-alive
        assert f"unloaded after {KEEP_ALIVE_S} s idle" in lazy
        events = text("#events")
        assert "model loaded" in events and "model unloaded" in events
        severe = [
            e for e in browser.get_log("browser") if e["level"] == "SEVERE" and "401" not in e["message"]
        ]
        assert severe == []  # no script error, no file the page could not load
    finally:
        browser.quit()
    assert (tmp_path / "status-page.png").read_bytes().startswith(b"\x89PNG")


# ---- the window of recent requests, on real statistics objects --------------------------------------------


def test_recent_requests_survive_a_reload_and_an_unload() -> None:
    """Differences are taken per version: a reload's fresh counters are no negative traffic, and what a
    version answered between its last reading and its unload still counts."""
    clock = Clock()
    served: dict[str, list[VersionStats]] = {"m": [VersionStats()]}
    recent = RecentActivity(lambda: served, step_s=5, window_s=60, clock=clock)
    old = served["m"][0]
    for _ in range(10):
        old.record_success(4_000_000, 1)
    recent.sample()  # 10 served before the window's first reading: not counted
    clock.now += 5
    for _ in range(5):
        old.record_success(4_000_000, 1)
    new = VersionStats()
    served["m"] = [new]  # reloaded: the old version answered 5 more, then left
    new.record_success(3_000_000, 1)
    new.record_failure(1_000, "INTERNAL")
    recent.sample()
    clock.now += 5
    figures = recent.figures()["m"]
    assert figures.window_s == 10
    assert figures.requests_per_s == pytest.approx(7 / 10)  # 5 + 1 + 1 failed
    assert figures.failures_per_s == pytest.approx(1 / 10)
    assert figures.series == [pytest.approx(7 / 5)]  # the whole step; the one under way is left out
    # six successful requests, all in the bucket (2 ms, 5 ms]: the median is interpolated halfway
    assert figures.quantiles_s[0.5] == pytest.approx(0.0035)
    served.clear()
    assert recent.figures() == {}


def test_quantiles_are_interpolated_within_their_bucket() -> None:
    buckets = [0] * (len(LATENCY_BUCKETS_S) + 1)
    assert quantile(0.5, buckets) is None
    i = LATENCY_BUCKETS_S.index(0.01)  # the bucket (0.005, 0.01]
    buckets[i] = 100
    assert quantile(0.5, buckets) == pytest.approx(0.0075)
    assert quantile(0.99, buckets) == pytest.approx(0.005 + 0.005 * 0.99)
    buckets[-1] = 100  # above every bound: the highest bound
    assert quantile(0.99, buckets) == LATENCY_BUCKETS_S[-1]
