"""The files one request enters in the daemon, measured: a profile hook in a real daemon process
(tests/walk_recorder.py) records every call into an mpsd file while one request of a kind is in flight, and
the recorded files are held to the walk docs/architecture.md gives for that kind: every file entered is
named in the walk (a stop, or a helper named inside a stop), nothing the walk lists goes unvisited, a walk
enters at most 15 files, and no call goes from a lower layer of the daemon into a higher one.

The recording runs from before the request is sent until its answer is back (the recorder says when it has
started, through a file), and calls are attributed by their root (the task or callback they run in, see the
recorder): the roots of the daemon's background loops below are left out by name, whatever they happen to
do meanwhile. One daemon serves every kind; each kind's request is sent twice first, so that what a first
request loads or learns is not its walk.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests import models, openai_models
from tests.conftest import ROOT, RunningDaemon, http_request, wait_for

MAX_FILES = 15
# Loops that run whether or not a request is in flight, by the root function their calls run under.
BACKGROUND = {
    "cli/__init__.py:main",  # the event loop's own select (net/busy_poll.py), below every task
    "daemon/main.py:run",  # the daemon's own coroutine: health follows its state
    "daemon/api/recent.py:_sample_forever",
    "daemon/core/residency/manager.py:_sweep_forever",
    "daemon/supervise/worker/liveness.py:_watch",
    "daemon/supervise/worker/liveness.py:_on_beat",
}
Call = tuple[str, str, str, str]  # (root "file:function", caller file, callee file, callee function)

CALLER = """
class Model:
    def __init__(self, config, device, models):
        self.models = models

    def infer(self, inputs):
        return {'y': self.models.infer('double', {'x': inputs['x']})['y']}
"""
DOUBLE = "return {'y': inputs['x'] * 2}"
F = {"data_type": "TYPE_FP32", "dims": [-1]}


def _repo(repo: Path) -> None:
    models.add_sub(repo)
    models.python_model(repo, "double", DOUBLE)
    caller = models.python_model(repo, "caller", DOUBLE)
    (caller / "1" / "model.py").write_text("import torch\n" + textwrap.dedent(CALLER))
    models.write_config(
        repo / "pipe",
        {
            "backend": "ensemble",
            "max_batch_size": 0,
            "input": [{"name": "X", **F}],
            "output": [{"name": "Y", **F}],
            "ensemble_scheduling": {
                "step": [{"model_name": "double", "input_map": {"x": "X"}, "output_map": {"y": "Y"}}]
            },
        },
    )
    (repo / "pipe" / "1").mkdir()
    openai_models.byte_counts(repo, "embed")


class Recorder:
    """One daemon run under the hook; `record(request)` is what one request enters."""

    def __init__(self, daemon: RunningDaemon, out: Path) -> None:
        self.daemon = daemon
        self.out = out

    def record(self, request: Callable[[], object]) -> set[Call]:
        request()  # twice before: what a first request loads or learns (a header, a template) is not the walk
        request()
        os.kill(self.daemon.pid, signal.SIGUSR1)
        wait_for(lambda: (self.out / "recording").exists(), 30, "the recording to start")
        request()
        os.kill(self.daemon.pid, signal.SIGUSR2)
        wait_for(lambda: (self.out / "walk.json").exists(), 30, "the recording to end")
        rows = json.loads((self.out / "walk.json").read_text())
        (self.out / "walk.json").unlink()
        return {tuple(row) for row in rows}  # type: ignore[misc]


@pytest.fixture(scope="module")
def recorder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Recorder]:
    tmp = tmp_path_factory.mktemp("walks")
    _repo(tmp / "repo")
    launcher = [sys.executable, str(ROOT / "tests" / "walk_recorder.py"), str(tmp)]
    daemon = RunningDaemon(tmp / "repo", tmp / "daemon.log", launcher=launcher)
    try:
        daemon.wait_ready(timeout=300)
        yield Recorder(daemon, tmp)
    finally:
        daemon.stop()
        daemon.kill_group()


A = np.ones((1, 16), np.float32)


def _grpc_inputs(rows: int = 1) -> list[grpcclient.InferInput]:
    tensors = []
    for name in ("INPUT0", "INPUT1"):
        tensor = grpcclient.InferInput(name, [rows, 16], "FP32")
        tensor.set_data_from_numpy(np.ones((rows, 16), np.float32))
        tensors.append(tensor)
    return tensors


def grpc_known(daemon: RunningDaemon) -> Callable[[], object]:
    return lambda: daemon.client.infer("add_sub", _grpc_inputs())


def grpc_new(daemon: RunningDaemon) -> Callable[[], object]:
    """Each call a header the daemon has not seen: a batch size not sent before (the known header's is 1; the
    key leaves the request's id out, so a new id would not do)."""
    rows = iter(range(2, 9))
    return lambda: daemon.client.infer("add_sub", _grpc_inputs(next(rows)))


def http_infer(daemon: RunningDaemon) -> Callable[[], object]:
    client = httpclient.InferenceServerClient(daemon.http_address)
    tensors = []
    for name in ("INPUT0", "INPUT1"):
        tensor = httpclient.InferInput(name, [1, 16], "FP32")
        tensor.set_data_from_numpy(A)
        tensors.append(tensor)
    return lambda: client.infer("add_sub", tensors)


def embeddings(daemon: RunningDaemon) -> Callable[[], object]:
    body = json.dumps({"model": "embed", "input": ["one text"]}).encode()

    def post() -> object:
        status, answer, _ = http_request(
            daemon.http_address, "POST", "/v1/embeddings", body, {"Content-Type": "application/json"}
        )
        assert status == 200, answer
        return answer

    return post


def _x(model: str, daemon: RunningDaemon, name: str = "x") -> Callable[[], object]:
    tensor = grpcclient.InferInput(name, [2], "FP32")
    tensor.set_data_from_numpy(np.ones(2, np.float32))
    return lambda: daemon.client.infer(model, [tensor])


# Each kind of request: what sends one, and which roots its walk is: every root but the background ones, or
# for a step of an ensemble and a model's call, the task that runs it and the worker's channel (the request
# that holds them walks its own protocol's walk).
CHANNEL = ("ipc/framing.py:",)  # the worker's messages, read in the socket's callbacks
KINDS: dict[str, tuple[Callable[[RunningDaemon], Callable[[], object]], tuple[str, ...] | None]] = {
    "gRPC ModelInfer, a known header": (grpc_known, None),
    "gRPC ModelInfer, a new header": (grpc_new, None),
    "HTTP infer": (http_infer, None),
    "OpenAI embeddings": (embeddings, None),
    "An ensemble step": (lambda d: _x("pipe", d, "X"), ("daemon/core/ensemble.py:_step", *CHANNEL)),
    "A python model's call to another model": (
        lambda d: _x("caller", d),
        ("daemon/core/calls.py:", "daemon/dataplane/calls.py:", *CHANNEL),
    ),
}
# Walks over MAX_FILES not cut yet, each at the files it enters now: one may only shrink.
OVER = {"gRPC ModelInfer, a new header": 19, "HTTP infer": 20, "OpenAI embeddings": 22}


@pytest.fixture(scope="module")
def walks(recorder: Recorder) -> dict[str, set[Call]]:
    """Each kind's calls, from one request of it, in one daemon."""
    recorded = {}
    for kind, (request, roots) in KINDS.items():
        calls = recorder.record(request(recorder.daemon))
        recorded[kind] = {
            c for c in calls if c[0] not in BACKGROUND and (roots is None or c[0].startswith(roots))
        }
    return recorded


def request_files(calls: set[Call]) -> set[str]:
    """The daemon-side files a walk's calls enter."""
    return {callee for _, _, callee, _ in calls}


DOC_PATH = re.compile(
    r"`((?:(?:daemon|api|core|dataplane|supervise|ipc|net|config|logs|worker)/)[\w/]+\.py|errors\.py)`"
)


def documented(kind: str) -> set[str]:
    """The daemon-side files docs/architecture.md names in the walk of `kind`: its stops and the helpers
    named inside them (relative to mpsd/, `api/...` short for `daemon/api/...`; the worker's left out)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split(f"### {kind}\n", 1)[1].split("\n#", 1)[0]
    files = set()
    for path in DOC_PATH.findall(section):
        if path.split("/", 1)[0] in ("api", "core", "dataplane", "supervise"):
            path = "daemon/" + path
        if not path.startswith("worker/"):
            files.add(path)
    return files


def layers() -> list[str]:
    """The daemon's layers, top first, as pyproject.toml's layers contract lists them."""
    text = (ROOT / "pyproject.toml").read_text()
    block = text.split('type = "layers"', 1)[1].split("]", 1)[0]  # its `layers = [...]`, one per line
    return re.findall(r'"([\w.]+)"', block)


def upward(calls: set[Call], order: list[str]) -> set[tuple[str, str]]:
    """The (caller, callee) file pairs where a module of a lower layer calls into a higher one."""

    def layer(path: str) -> int | None:
        module = "mpsd." + path.removesuffix(".py").replace("/", ".")
        return next((i for i, p in enumerate(order) if module == p or module.startswith(p + ".")), None)

    found = set()
    for _, caller, callee, _ in calls:
        above, below = layer(callee), layer(caller)
        if above is not None and below is not None and below > above:
            found.add((caller, callee))
    return found


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_request_enters_the_files_its_walk_names_and_no_other(
    walks: dict[str, set[Call]], kind: str
) -> None:
    entered, listed = request_files(walks[kind]), documented(kind)
    assert {
        "entered, not in the walk": sorted(entered - listed),
        "in the walk, not entered": sorted(listed - entered),
    } == {
        "entered, not in the walk": [],
        "in the walk, not entered": [],
    }


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_walk_enters_at_most_15_daemon_side_files(walks: dict[str, set[Call]], kind: str) -> None:
    assert len(request_files(walks[kind])) <= OVER.get(kind, MAX_FILES), sorted(request_files(walks[kind]))


@pytest.mark.parametrize("kind", list(KINDS))
def test_no_call_of_a_walk_goes_up_a_layer(walks: dict[str, set[Call]], kind: str) -> None:
    assert upward(walks[kind], layers()) == set()


def test_the_checks_find_a_call_up_a_layer_and_a_helper_named_in_a_stop() -> None:
    """The checks themselves: a data plane module calling core is upward, api calling core is not; a walk's
    helper named inside a stop counts as listed."""
    order = layers()
    calls = {
        ("r", "daemon/dataplane/calls.py", "daemon/core/calls.py", "f"),
        ("r", "daemon/api/pipeline.py", "daemon/core/registry.py", "g"),
        ("r", "ipc/framing.py", "daemon/dataplane/channel.py", "h"),
    }
    assert upward(calls, order) == {("daemon/dataplane/calls.py", "daemon/core/calls.py")}
    assert "daemon/dataplane/queue.py" in documented("gRPC ModelInfer, a known header")
