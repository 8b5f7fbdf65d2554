"""Stateful sequences (sequence batching) on a real daemon, driven by the stock clients.

The steps of Triton's four sequence examples (triton-inference-server/client, src/python/examples:
simple_grpc_sequence_sync_infer_client, simple_http_sequence_sync_infer_client,
simple_grpc_sequence_stream_infer_client, simple_grpc_aio_sequence_stream_infer_client), with and without
`--dyna`, against python equivalents of Triton's test backends (tests/sequence_models.py); then what the
examples do not show: two sequences interleaved on one stream, the oldest strategy batching sequences,
the backlog and the idle timeout, implicit state (python and TorchScript), Triton's errors, a worker killed
mid-sequence, and the metrics.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import signal
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
import yaml
from torch import nn
from tritonclient.utils import InferenceServerException

from tests import models, sequence_models
from tests.conftest import RunningDaemon, serving, wait_for

VALUES = [11, 7, 5, 3, 2, 0, 1]  # what every example sends after its first value


class TorchAccumulate(nn.Module):
    """A TorchScript model with implicit state: the sum of the sequence's inputs so far."""

    def forward(
        self, x: torch.Tensor, start: torch.Tensor, state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        total = state + x
        return total, total


STATE = """
  state [ {{
    input_name: "ACC_IN" output_name: "ACC_OUT" data_type: TYPE_INT32 dims: [ 1 ]
    initial_state {{ data_type: TYPE_INT32 dims: [ 1 ] {initial} }}
  }} ]"""


def _state_models(repo: Path) -> None:
    controls = sequence_models._controls(sequence_models.START_READY[0])
    pbtxt = sequence_models._pbtxt("state_py", controls, extra=STATE.format(initial='data_file: "hundred"'))
    infer = """
        total = inputs['ACC_IN'] + inputs['INPUT']
        return {'OUTPUT': total, 'ACC_OUT': total}
"""
    model_dir = sequence_models._python(repo, "state_py", pbtxt, infer)
    (model_dir / "initial_state").mkdir()
    (model_dir / "initial_state" / "hundred").write_bytes(np.array([100], dtype=np.int32).tobytes())
    # The same, reading the request's own parameters: `step` adds to the state instead of the input.
    pbtxt = sequence_models._pbtxt("state_params", controls, extra=STATE.format(initial="zero_data: true"))
    params = sequence_models._python(repo, "state_params", pbtxt, "")
    params_code = (
        (params / "1" / "model.py")
        .read_text()
        .replace(
            "def infer(self, inputs):\n",
            "def infer(self, inputs, parameters):\n"
            "        total = inputs['ACC_IN'] + int(parameters.get('step', 0))\n"
            "        return {'OUTPUT': total, 'ACC_OUT': total}\n",
        )
    )
    (params / "1" / "model.py").write_text(params_code)
    ts = repo / "state_ts"
    (ts / "1").mkdir(parents=True)
    pbtxt = sequence_models._pbtxt("state_ts", controls, extra=STATE.format(initial="zero_data: true"))
    (ts / "config.pbtxt").write_text(pbtxt.replace('backend: "python"', 'platform: "pytorch_libtorch"'))
    models.save_torchscript(TorchAccumulate(), ts / "1" / "model.pt")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    tmp = tmp_path_factory.mktemp("sequences")
    repo = tmp / "repo"
    sequence_models.simple_sequence(repo, instances=2)
    sequence_models.simple_dyna_sequence(repo, instances=1)
    sequence_models.simple_string_dyna_sequence(repo, instances=2)
    sequence_models.accumulator(repo, "acc_direct")
    oldest = "oldest { max_candidate_sequences: 4 preferred_batch_size: [ 4 ] "
    oldest += "max_queue_delay_microseconds: 3000000 }"
    sequence_models.accumulator(repo, "acc_oldest", strategy=oldest)
    sequence_models.accumulator(repo, "acc_one", idle_us=700000)
    (repo / "acc_one" / "config.pbtxt").write_text(
        (repo / "acc_one" / "config.pbtxt").read_text().replace("max_batch_size: 8", "max_batch_size: 1")
    )
    _state_models(repo)
    # The reload and residency tests keep a sequence live across a worker's start, which takes seconds on a
    # loaded machine: their sequences' idle timeout (2 minutes) must not end them meanwhile.
    long_idle = 120_000_000
    sequence_models.accumulator(repo, "acc_reload", idle_us=long_idle)
    keep = 'parameters [ { key: "mpsd.residency.load" value: { string_value: "on_demand" } }, '
    keep += '{ key: "mpsd.residency.keep_alive_s" value: { string_value: "1" } } ]\n'
    for name in ("acc_kept", "canary"):
        pbtxt = sequence_models.accumulator(repo, name, idle_us=long_idle) / "config.pbtxt"
        pbtxt.write_text(pbtxt.read_text() + keep)
    cached = sequence_models.accumulator(repo, "acc_cached") / "config.pbtxt"
    cached.write_text(cached.read_text() + "response_cache { enable: true }\n")
    config = tmp / "mpsd.yaml"
    settings = {
        "server_name": "triton",
        "metrics_address": f"127.0.0.1:{_port()}",
        "model_control": "explicit",
        "response_cache_bytes": 1 << 20,
    }
    config.write_text(yaml.safe_dump(settings))
    env = {"ACCUMULATOR_LOG": str(tmp / "executions.log")}
    with serving(repo, tmp / "daemon.log", config=config, env=env) as d:
        d.executions = tmp / "executions.log"  # type: ignore[attr-defined]
        d.metrics = yaml.safe_load(config.read_text())["metrics_address"]  # type: ignore[attr-defined]
        yield d


def _port() -> int:
    from tests.conftest import free_port

    return free_port()


# ---- Triton's examples ------------------------------------------------------------------------------


def _expected(dyna: bool, ids: tuple[int, int, str], string_results: list[int]) -> list[tuple[int, int, int]]:
    """What the examples check, row by row (their own computation, for simple_sequence and the dyna ones)."""
    rows = []
    for i in range(len(VALUES) + 1):
        seq0 = 1 if i == 0 else VALUES[i - 1]
        seq1 = 101 if i == 0 else -VALUES[i - 1]
        if i == 0:
            text = 20 if dyna else 21
        elif dyna:
            text = -VALUES[i - 1] + string_results[i - 1]
        else:
            text = -VALUES[i - 1]
        if dyna and i != 0 and VALUES[i - 1] == 1:
            seq0 += ids[0]
            seq1 += ids[1]
            text += int(ids[2])
        rows.append((seq0, seq1, text))
    return rows


def _sequences(dyna: bool) -> list[tuple[str, int | str, list[int]]]:
    int_model = "simple_dyna_sequence" if dyna else "simple_sequence"
    string_model = "simple_string_dyna_sequence" if dyna else "simple_sequence"
    string_id = "1002" if dyna else str(uuid.uuid4())
    return [
        (int_model, 1000, [0, *VALUES]),
        (int_model, 1001, [100, *(-v for v in VALUES)]),
        (string_model, string_id, [20, *(-v for v in VALUES)]),
    ]


def _inputs(module: Any, value: int) -> list[Any]:
    tensor = module.InferInput("INPUT", [1, 1], "INT32")
    tensor.set_data_from_numpy(np.full((1, 1), value, dtype=np.int32))
    return [tensor]


def _check(dyna: bool, results: list[list[int]], string_id: int | str) -> None:
    rows = list(zip(*results, strict=True))
    assert rows == _expected(dyna, (1000, 1001, str(string_id)), results[2])


@pytest.mark.parametrize("dyna", [False, True])
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_the_sync_examples(daemon: RunningDaemon, protocol: str, dyna: bool) -> None:
    """simple_grpc_sequence_sync_infer_client and simple_http_sequence_sync_infer_client: three sequences
    one after another, each request waiting for its answer."""
    module: Any = grpcclient if protocol == "grpc" else httpclient
    url = daemon.address if protocol == "grpc" else daemon.http_address
    client = module.InferenceServerClient(url)
    results = []
    sequences = _sequences(dyna)
    for model, corrid, values in sequences:
        outputs = []
        for count, value in enumerate(values, 1):
            result = client.infer(
                model,
                _inputs(module, value),
                outputs=[module.InferRequestedOutput("OUTPUT")],
                sequence_id=corrid,
                sequence_start=count == 1,
                sequence_end=count == len(values),
            )
            outputs.append(int(result.as_numpy("OUTPUT")[0][0]))
        results.append(outputs)
    client.close()
    _check(dyna, results, sequences[2][1])


def _by_sequence(responses: list[Any], sequences: list[tuple[str, int | str, list[int]]]) -> list[list[int]]:
    """The examples' sorting of stream responses by the sequence named in their request id."""
    results: list[list[int]] = [[], [], []]
    for response in responses:
        this_id = response.get_response().id.split("_")[0]
        index = [str(corrid) for _, corrid, _ in sequences].index(this_id)
        results[index].append(int(response.as_numpy("OUTPUT")[0][0]))
    return results


@pytest.mark.parametrize("dyna", [False, True])
def test_the_stream_example(daemon: RunningDaemon, dyna: bool) -> None:
    """simple_grpc_sequence_stream_infer_client: the three sequences' requests all sent on one stream,
    the responses read afterwards."""
    sequences = _sequences(dyna)
    answers: queue.Queue[Any] = queue.Queue()
    with grpcclient.InferenceServerClient(daemon.address) as client:
        client.start_stream(callback=lambda result, error: answers.put(error or result))
        for model, corrid, values in sequences:
            for count, value in enumerate(values, 1):
                client.async_stream_infer(
                    model,
                    _inputs(grpcclient, value),
                    outputs=[grpcclient.InferRequestedOutput("OUTPUT")],
                    request_id=f"{corrid}_{count}",
                    sequence_id=corrid,
                    sequence_start=count == 1,
                    sequence_end=count == len(values),
                )
        responses = [answers.get(timeout=60) for _ in range(3 * (len(VALUES) + 1))]
    errors = [r for r in responses if isinstance(r, InferenceServerException)]
    assert not errors, errors
    _check(dyna, _by_sequence(responses, sequences), sequences[2][1])


@pytest.mark.parametrize("dyna", [False, True])
def test_the_aio_stream_example(daemon: RunningDaemon, dyna: bool) -> None:
    """simple_grpc_aio_sequence_stream_infer_client: the same through grpc.aio's stream_infer and a request
    iterator."""
    sequences = _sequences(dyna)

    async def run() -> list[Any]:
        async with grpcaio.InferenceServerClient(daemon.address) as client:

            async def requests() -> Any:
                for model, corrid, values in sequences:
                    for count, value in enumerate(values, 1):
                        yield {
                            "model_name": model,
                            "inputs": _inputs(grpcaio, value),
                            "outputs": [grpcaio.InferRequestedOutput("OUTPUT")],
                            "request_id": f"{corrid}_{count}",
                            "sequence_id": corrid,
                            "sequence_start": count == 1,
                            "sequence_end": count == len(values),
                        }

            answers = []
            async for result, error in client.stream_infer(inputs_iterator=requests()):
                assert error is None, error
                answers.append(result)
                if len(answers) == 3 * (len(VALUES) + 1):
                    break
            return answers

    _check(dyna, _by_sequence(asyncio.run(run()), sequences), sequences[2][1])


# ---- beyond the examples ----------------------------------------------------------------------------


def _step(
    client: grpcclient.InferenceServerClient,
    model: str,
    corrid: int | str,
    value: int,
    start: bool = False,
    end: bool = False,
) -> int:
    result = client.infer(
        model,
        _inputs(grpcclient, value),
        sequence_id=corrid,
        sequence_start=start,
        sequence_end=end,
        client_timeout=30,
    )
    return int(result.as_numpy("OUTPUT")[0][0])


def _refusal(call: Callable[[], object]) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as refused:
        call()
    return str(refused.value.status()), str(refused.value.message())


def _executions(daemon: RunningDaemon) -> list[tuple[int, int, list[int]]]:
    """(pid, batch size, correlation IDs) of each accumulator execution, in order."""
    path: Path = daemon.executions  # type: ignore[attr-defined]
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        pid, size, *ids = line.split()
        rows.append((int(pid), int(size), [int(i) for i in ids]))
    return rows


def test_two_sequences_interleaved_on_one_stream_keep_their_own_sums(daemon: RunningDaemon) -> None:
    answers: queue.Queue[Any] = queue.Queue()
    steps = [(51, 1, True, False), (52, 10, True, False), (51, 2, False, False), (52, 20, False, False)]
    steps += [(51, 3, False, True), (52, 30, False, True)]
    with grpcclient.InferenceServerClient(daemon.address) as client:
        client.start_stream(callback=lambda result, error: answers.put(error or result))
        for n, (corrid, value, start, end) in enumerate(steps):
            client.async_stream_infer(
                "acc_direct",
                _inputs(grpcclient, value),
                request_id=f"{corrid}_{n}",
                sequence_id=corrid,
                sequence_start=start,
                sequence_end=end,
            )
        responses = [answers.get(timeout=60) for _ in steps]
    sums: dict[str, list[int]] = {"51": [], "52": []}
    for response in responses:
        assert not isinstance(response, InferenceServerException), response
        sums[response.get_response().id.split("_")[0]].append(int(response.as_numpy("OUTPUT")[0][0]))
    assert sums == {"51": [1, 3, 6], "52": [10, 30, 60]}


def test_a_sequence_stays_on_one_instance(daemon: RunningDaemon) -> None:
    """simple_string_dyna_sequence (two instances) keeps its sums in the instance: each sequence must stay
    on the one it started on."""
    client = daemon.client
    totals = {}
    for corrid in ("7001", "7002", "7003", "7004"):
        totals[corrid] = _step(client, "simple_string_dyna_sequence", corrid, 1, start=True)
    for _ in range(3):
        for corrid in totals:
            totals[corrid] = _step(client, "simple_string_dyna_sequence", corrid, 1)
    assert set(totals.values()) == {4}
    for corrid in totals:  # END adds the ID
        assert _step(client, "simple_string_dyna_sequence", corrid, 1, end=True) == 5 + int(corrid)


def test_the_oldest_strategy_batches_requests_of_several_sequences(daemon: RunningDaemon) -> None:
    """Four sequences' requests sent at once run as one execution of four rows (preferred_batch_size 4),
    start, middle and end alike."""
    client = daemon.client
    ids = [301, 302, 303, 304]
    before = len(_executions(daemon))
    with ThreadPoolExecutor(4) as pool:
        for start, end, want in ((True, False, 1), (False, False, 2), (False, True, 3)):
            got = list(pool.map(lambda c, s=start, e=end: _step(client, "acc_oldest", c, 1, s, e), ids))
            assert got == [want] * 4
    runs = [r for r in _executions(daemon)[before:] if set(r[2]) <= set(ids)]
    assert [(size, sorted(corrids)) for _, size, corrids in runs] == [(4, ids)] * 3


def test_a_sequence_beyond_the_slots_waits_for_one(daemon: RunningDaemon) -> None:
    """acc_one has one slot (max_batch_size 1): a second sequence waits in the backlog, as in Triton, and
    runs once the first ends."""
    client = daemon.client
    before = len(_executions(daemon))
    assert _step(client, "acc_one", 401, 5, start=True) == 5
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(_step, client, "acc_one", 402, 7, True)
        wait_for(lambda: _metric(daemon, "mpsd_sequences_live", "acc_one") == 2, 30, "402 in the daemon")
        assert _step(client, "acc_one", 401, 5) == 10
        assert _step(client, "acc_one", 401, 5, end=True) == 15
        assert waiting.result(timeout=30) == 7
    assert _step(client, "acc_one", 402, 1, end=True) == 8
    runs = [ids for _, _, ids in _executions(daemon)[before:] if set(ids) & {401, 402}]
    assert runs == [[401], [401], [401], [402], [402]]  # 402's start ran only once 401 had ended


def _metric(daemon: RunningDaemon, name: str, model: str) -> float:
    import urllib.request

    text = urllib.request.urlopen(f"http://{daemon.metrics}/metrics", timeout=10).read().decode()  # type: ignore[attr-defined]
    for line in text.splitlines():
        if line.startswith(f'{name}{{model="{model}",version="1"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_an_idle_sequence_is_ended_and_its_slot_freed(daemon: RunningDaemon) -> None:
    """Past max_sequence_idle_microseconds (0.7 s) a sequence is ended: the sequence waiting in the backlog
    gets the slot, and the idle one's next request is answered as one that never started (Triton's words)."""
    client = daemon.client
    timed_out = _metric(daemon, "mpsd_sequences_timed_out_total", "acc_one")
    assert _step(client, "acc_one", 501, 5, start=True) == 5
    assert _step(client, "acc_one", 502, 7, start=True) == 7  # waited for 501 to time out
    assert _metric(daemon, "mpsd_sequences_timed_out_total", "acc_one") == timed_out + 1
    wait_for(
        lambda: _metric(daemon, "mpsd_sequences_timed_out_total", "acc_one") == timed_out + 2, 10, "502 ends"
    )
    status, message = _refusal(lambda: _step(client, "acc_one", 501, 1))
    assert (status, message) == (
        "StatusCode.INVALID_ARGUMENT",
        "inference request for sequence 501 to model 'acc_one' must specify the START flag on the first "
        "request of the sequence",
    )


@pytest.mark.parametrize("model", ["state_py", "state_ts"])
def test_implicit_state_is_kept_per_sequence_by_the_worker(daemon: RunningDaemon, model: str) -> None:
    """The model sees its state as an input and returns the next value; the client sees neither. state_py
    starts from its initial_state data file (100), state_ts from zeros."""
    client = daemon.client
    base = 100 if model == "state_py" else 0
    assert _step(client, model, 61, 1, start=True) == base + 1
    assert _step(client, model, 62, 10, start=True) == base + 10
    assert _step(client, model, 61, 2) == base + 3
    assert _step(client, model, 62, 20) == base + 30
    assert _step(client, model, 61, 3, end=True) == base + 6
    assert _step(client, model, 61, 4, start=True) == base + 4  # started again: from the initial state
    assert _step(client, model, 62, 30, end=True) == base + 60
    result = client.infer(model, _inputs(grpcclient, 1), sequence_id=61, sequence_end=True)
    assert [o.name for o in result.get_response().outputs] == ["OUTPUT"]
    assert int(result.as_numpy("OUTPUT")[0][0]) == base + 5


def test_implicit_state_with_the_request_s_own_parameters(daemon: RunningDaemon) -> None:
    """A python model that reads its request's parameters (`infer(inputs, parameters)`) keeps state too."""

    def step(value: int, **flags: bool) -> int:
        result = daemon.client.infer(
            "state_params", _inputs(grpcclient, 0), sequence_id=71, parameters={"step": value}, **flags
        )
        return int(result.as_numpy("OUTPUT")[0][0])

    assert [step(2, sequence_start=True), step(3), step(4, sequence_end=True)] == [2, 5, 9]


def test_triton_errors_for_requests_that_are_no_sequence_step(daemon: RunningDaemon) -> None:
    client = daemon.client
    assert _refusal(lambda: client.infer("acc_direct", _inputs(grpcclient, 1))) == (
        "StatusCode.INVALID_ARGUMENT",
        "inference request to model 'acc_direct' must specify a non-zero or non-empty correlation ID",
    )
    assert _refusal(lambda: _step(client, "acc_direct", 777, 1)) == (
        "StatusCode.INVALID_ARGUMENT",
        "inference request for sequence 777 to model 'acc_direct' must specify the START flag on the first "
        "request of the sequence",
    )
    two = grpcclient.InferInput("INPUT", [2, 1], "INT32")
    two.set_data_from_numpy(np.ones((2, 1), dtype=np.int32))
    assert _refusal(lambda: client.infer("acc_direct", [two], sequence_id=5, sequence_start=True)) == (
        "StatusCode.INVALID_ARGUMENT",
        "inference request to model 'acc_direct' must specify batch-size 1 due to requirements of sequence "
        "batcher",
    )
    assert _refusal(lambda: _step(client, "acc_direct", "a" * 129, 1, start=True)) == (
        "StatusCode.INVALID_ARGUMENT",
        "string correlation ID cannot be longer than 128 characters",  # docs/api.md, as Triton's
    )
    status, message = _refusal(lambda: _step(client, "acc_direct", "abc", 1, start=True))
    assert (
        status == "StatusCode.INVALID_ARGUMENT"
        and "correlation ID in request is not an unsigned int" in message
    )
    http = httpclient.InferenceServerClient(daemon.http_address)
    with pytest.raises(InferenceServerException) as refused:
        http.infer("acc_direct", _inputs(httpclient, 1), sequence_id=778)
    assert refused.value.status() == "400"
    assert "must specify the START flag on the first request of the sequence" in str(refused.value.message())


def test_a_worker_killed_mid_sequence_loses_its_sequences(daemon: RunningDaemon) -> None:
    """Its sequences' state was in the worker: their next requests fail saying so; new sequences run on
    the replacement worker."""
    client = daemon.client
    assert _step(client, "acc_direct", 91, 4, start=True) == 4
    lost = _metric(daemon, "mpsd_sequences_lost_total", "acc_direct")
    [pid] = daemon.started_workers("acc_direct")
    os.kill(pid, signal.SIGKILL)
    wait_for(
        lambda: len(daemon.started_workers("acc_direct")) == 2 and client.is_model_ready("acc_direct"),
        60,
        "replacement",
    )
    status, message = _refusal(lambda: _step(client, "acc_direct", 91, 1))
    assert status == "StatusCode.UNAVAILABLE"
    assert message.startswith(
        "inference request for sequence 91 to model 'acc_direct': the sequence was lost (its instance's "
        "worker stopped"
    ), message
    assert _metric(daemon, "mpsd_sequences_lost_total", "acc_direct") == lost + 1
    assert _step(client, "acc_direct", 91, 2, start=True) == 2
    assert _step(client, "acc_direct", 91, 3, end=True) == 5


def test_a_reload_lets_live_sequences_finish_on_the_old_version(daemon: RunningDaemon) -> None:
    """After a reload with new model code, the sequence that was live goes on with the old code and its sum;
    a new sequence runs the new code; once the last old sequence ends, the old version's worker stops."""
    client = daemon.client
    assert _step(client, "acc_reload", 11, 1, start=True) == 1
    [old_pid] = daemon.started_workers("acc_reload")
    model = daemon.repo / "acc_reload" / "1" / "model.py"
    model.write_text(
        model.read_text().replace("out.append(self.sums[corrid])", "out.append(1000 + self.sums[corrid])")
    )
    client.load_model("acc_reload")
    assert _step(client, "acc_reload", 12, 5, start=True) == 1005  # new sequences: the new version
    assert _step(client, "acc_reload", 11, 2) == 3  # the live one: the old version, its sum kept
    assert _step(client, "acc_reload", 12, 5) == 1010
    assert _pid_alive(old_pid)
    assert _step(client, "acc_reload", 11, 3, end=True) == 6
    wait_for(lambda: not _pid_alive(old_pid), 30, "the old version's worker stops once its sequence ended")
    assert "must specify the START flag" in _refusal(lambda: _step(client, "acc_reload", 11, 1))[1]
    assert _step(client, "acc_reload", 12, 1, end=True) == 1011


def _pid_alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_the_response_cache_never_answers_a_sequence_step(daemon: RunningDaemon) -> None:
    """acc_cached enables the response cache: its sequence's second and third requests are the same bytes,
    and each is answered by the model."""
    client = daemon.client
    assert [_step(client, "acc_cached", 31, 5, start=True), _step(client, "acc_cached", 31, 5)] == [5, 10]
    assert _step(client, "acc_cached", 31, 5) == 15
    assert _step(client, "acc_cached", 31, 5, end=True) == 20


def _unloaded(daemon: RunningDaemon) -> list[str]:
    events = [json.loads(line) for line in daemon.log().splitlines() if line.startswith("{")]
    return [e["model"] for e in events if e.get("event") == "model unloaded"]


def test_a_model_with_a_live_sequence_is_in_use(daemon: RunningDaemon) -> None:
    """acc_kept and canary load on demand and unload after 1 s idle. canary, used once the sequence has
    started, is unloaded first: by then the sweeper has looked at acc_kept more than 1 s after its last
    request, and left it loaded, since its sequence is live; once that ends, acc_kept is unloaded too."""
    client = daemon.client
    assert _step(client, "acc_kept", 42, 1, start=True) == 1
    assert _step(client, "canary", 43, 1, start=True, end=True) == 1
    wait_for(lambda: "canary" in _unloaded(daemon), 30, "canary's idle unload")
    assert "acc_kept" not in _unloaded(daemon) and client.is_model_ready("acc_kept")
    assert _step(client, "acc_kept", 42, 2, end=True) == 3
    wait_for(lambda: "acc_kept" in _unloaded(daemon), 30, "acc_kept's idle unload once its sequence ended")


def test_live_sequences_are_counted(daemon: RunningDaemon) -> None:
    started = _metric(daemon, "mpsd_sequences_started_total", "acc_direct")
    ended = _metric(daemon, "mpsd_sequences_ended_total", "acc_direct")
    live = _metric(daemon, "mpsd_sequences_live", "acc_direct")
    assert _step(daemon.client, "acc_direct", 81, 1, start=True) == 1
    assert _metric(daemon, "mpsd_sequences_live", "acc_direct") == live + 1
    assert _step(daemon.client, "acc_direct", 81, 1, end=True) == 2
    assert _metric(daemon, "mpsd_sequences_live", "acc_direct") == live
    assert _metric(daemon, "mpsd_sequences_started_total", "acc_direct") == started + 1
    assert _metric(daemon, "mpsd_sequences_ended_total", "acc_direct") == ended + 1
