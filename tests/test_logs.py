"""Device logs: the event bus on its own, then StreamLogs and LogSettings against a real daemon.

The promises: what a worker prints, an exception a model raises and a worker's death reach a log client
tagged with model and pid; replay returns the past; a client that stops reading never slows inference and
is told how many events it lost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import yaml
from tritonclient.utils import InferenceServerException

from mpsd.errors import InvalidArgument
from mpsd.logs import apply_log_settings, log_settings, set_level
from mpsd.logs.events import EventBus, EventFilter, classify, parse_label
from mpsd.proto import admin_pb2, admin_pb2_grpc
from tests import models
from tests.conftest import RunningDaemon, serving, wait_for

# ---- the bus on its own ------------------------------------------------------------------------------


def log_event(message: str, **fields: object) -> dict[str, object]:
    return {"event": message, "level": "info", "timestamp": "2026-01-01T00:00:00Z", **fields}


def test_a_slow_subscriber_loses_its_oldest_events_and_is_told() -> None:
    async def scenario() -> list[tuple[int, int]]:
        bus = EventBus(history=100, capacity=3)
        _, sub = bus.subscribe(EventFilter())
        for i in range(5):
            bus.publish(log_event(f"event {i}"))
        got = []
        for _ in range(3):
            item = await sub.get()
            assert item is not None
            got.append((item[0].seq, item[1]))
        assert sub.dropped_total == 2
        bus.close_subscriptions()
        assert await sub.get() is None
        return got

    assert asyncio.run(scenario()) == [(3, 2), (4, 0), (5, 0)]


def test_the_daemon_keeps_2000_events_and_a_reader_queues_1000() -> None:
    """docs/observability.md's figures, with the bus's defaults: the last 2000 events replay, and a reader
    that reads nothing while 1500 arrive loses its oldest 500 and is told so with the next one."""

    async def scenario() -> tuple[list[int], tuple[int, int]]:
        bus = EventBus()
        for i in range(2500):
            bus.publish(log_event(f"old {i}"))
        past, sub = bus.subscribe(EventFilter(), replay=5000)
        for i in range(1500):
            bus.publish(log_event(f"new {i}"))
        item = await sub.get()
        assert item is not None
        bus.close_subscriptions()
        return [e.seq for e in past], (item[0].seq, item[1])

    past, (first_seq, dropped) = asyncio.run(scenario())
    assert past == list(range(501, 2501))
    assert (first_seq, dropped) == (2501 + 500, 500)


def test_replay_then_live_without_gap_or_duplicate() -> None:
    async def scenario() -> tuple[list[str], list[str]]:
        bus = EventBus(history=100)
        for i in range(4):
            bus.publish(log_event(f"old {i}", model="a" if i % 2 else "b"))
        past, sub = bus.subscribe(EventFilter(model="a"), replay=10)
        bus.publish(log_event("new", model="a"))
        bus.publish(log_event("other", model="b"))
        bus.close_subscriptions()
        live = []
        while (item := await sub.get()) is not None:
            live.append(item[0].message)
        return [e.message for e in past], live

    assert asyncio.run(scenario()) == (["old 1", "old 3"], ["new"])


def test_events_are_classified_and_tagged() -> None:
    fallback = (
        "UserWarning: The operator 'aten::foo' is not currently supported on the MPS backend and will "
        "fall back to run on the CPU."
    )
    assert classify(fallback, {"source": "worker.stderr"}) == "mps_fallback"
    assert classify("Traceback (most recent call last):", {"source": "worker.stderr"}) == "stderr"
    assert classify("hello", {"source": "worker.stdout"}) == "stdout"
    assert classify("worker died", {}) == "crash"
    assert classify("reload requested (SIGHUP)", {}) == "reload"
    assert classify("anything", {"event_kind": "memory"}) == "memory"
    assert parse_label("my/model/3#1") == ("my/model", 3)
    assert parse_label("resnet/2") == ("resnet", 2)

    async def tagged() -> None:
        bus = EventBus()
        event = bus.publish(log_event("worker died", worker="resnet/2#0", pid=42, exit="exit code 1"))
        assert (event.model, event.version, event.pid, event.kind) == ("resnet", 2, 42, "crash")
        assert event.fields == {"exit": "exit code 1"}

    asyncio.run(tagged())


def test_filters_check_level_and_kind() -> None:
    with pytest.raises(ValueError, match="unknown level"):
        EventFilter(level="verbose")
    with pytest.raises(ValueError, match="unknown event kind"):
        EventFilter(kinds=frozenset({"nonsense"}))
    bus = EventBus()
    event = bus.publish(log_event("worker died", level="error"))
    assert EventFilter(level="warning", kinds=frozenset({"crash"})).matches(event)
    assert not EventFilter(kinds=frozenset({"load"})).matches(event)
    assert not EventFilter(model="other").matches(event)


def test_log_settings_are_all_or_nothing() -> None:
    try:
        assert apply_log_settings({"log_info": False})["log_warning"] is True
        with pytest.raises(InvalidArgument, match="must be a bool"):
            apply_log_settings({"log_info": 1, "log_warning": False})
        assert log_settings()["log_warning"] is True  # the valid part of a refused request is not applied
        off = apply_log_settings({"log_warning": False, "log_error": False})
        assert not any(off[k] for k in ("log_info", "log_warning", "log_error", "log_verbose_level"))
        assert apply_log_settings({"log_verbose_level": 2})["log_info"] is True
    finally:
        set_level("info")


def _choices(parser: argparse.ArgumentParser, command: str, option: str) -> tuple[str, ...]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    action = next(a for a in sub.choices[command]._actions if option in a.option_strings)
    return tuple(action.choices or ())


def test_every_chosen_level_is_known_to_config_output_stream_and_command_line() -> None:
    """One table: a level the config accepts is one `serve --log-level`, `logs --level`, the output threshold
    and the event stream accept too, and the other way round."""
    from pydantic import ValidationError

    from mpsd.cli import build_parser
    from mpsd.config.daemon_config import DaemonConfig
    from mpsd.logs.levels import CHOICES, SEVERITIES

    parser = build_parser()
    assert _choices(parser, "serve", "--log-level") == CHOICES
    assert _choices(parser, "logs", "--level") == CHOICES
    try:
        for level in CHOICES:
            assert DaemonConfig(log_level=level).log_level == level
            set_level(level)
            assert EventFilter(level=level).level == level
    finally:
        set_level("info")
    for outside in sorted(set(SEVERITIES) - set(CHOICES)):  # critical: an event's severity, not a choice
        with pytest.raises(ValidationError):
            DaemonConfig(log_level=outside)  # type: ignore[arg-type]


# ---- against a real daemon ---------------------------------------------------------------------------

FLOOD_LINES = 40


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    repo = tmp_path_factory.mktemp("repo")
    positive = "if float(inputs['x'].sum()) > 0:  # never the warm-up's zeros\n"
    models.python_model(
        repo,
        "chatty",
        positive + "    print('marker', int(inputs['x'].sum()), flush=True)\nreturn {'y': inputs['x']}",
    )
    models.python_model(
        repo,
        "raiser",
        positive + "    raise ValueError('boom ' + str(int(inputs['x'].sum())))\nreturn {'y': inputs['x']}",
    )
    models.python_model(repo, "victim", "return {'y': inputs['x']}")
    models.python_model(
        repo,
        "flood",
        positive + f"    for i in range({FLOOD_LINES}):\n        print('flood', i, 'x' * 200)\n"
        "    sys.stdout.flush()\nreturn {'y': inputs['x']}",
    )
    config = tmp_path_factory.mktemp("config") / "mpsd.yaml"
    config.write_text(yaml.safe_dump({"metrics_address": "", "model_control": "explicit"}))
    with serving(repo, tmp_path_factory.mktemp("log") / "daemon.log", config=config) as d:
        yield d


@pytest.fixture(scope="module")
def admin(daemon: RunningDaemon) -> Iterator[admin_pb2_grpc.MpsdAdminStub]:
    with grpc.insecure_channel(daemon.address) as channel:
        yield admin_pb2_grpc.MpsdAdminStub(channel)


def infer(daemon: RunningDaemon, model: str, value: float) -> None:
    inp = grpcclient.InferInput("x", [1], "FP32")
    inp.set_data_from_numpy(np.array([value], np.float32))
    daemon.client.infer(model, [inp])


def pid_of(admin: admin_pb2_grpc.MpsdAdminStub, model: str) -> int:
    [worker] = admin.ListWorkers(admin_pb2.ListWorkersRequest(model=model), timeout=10).workers
    return int(worker.pid)


def replay(admin: admin_pb2_grpc.MpsdAdminStub, **request: object) -> list[admin_pb2.LogEvent]:
    return list(admin.StreamLogs(admin_pb2.StreamLogsRequest(replay=2000, **request), timeout=30))


def test_a_worker_reports_its_memory_about_every_5_s(
    daemon: RunningDaemon, admin: admin_pb2_grpc.MpsdAdminStub
) -> None:
    """`memory` events (debug level) come from each worker about every 5 s: two in a row of one idle
    worker are 4 to 7.5 s apart by the daemon's time stamps."""
    pid = pid_of(admin, "chatty")
    request = admin_pb2.StreamLogsRequest(
        model="chatty", level="debug", kinds=["memory"], replay=2000, follow=True
    )
    stream = admin.StreamLogs(request, timeout=60)
    times = []
    for event in stream:  # the past ones first, then live ones until there are two
        if event.pid == pid:
            times.append(datetime.fromisoformat(event.time.replace("Z", "+00:00")))
            assert "rss_bytes" in event.fields
        if len(times) == 2:
            break
    stream.cancel()
    gap = (times[1] - times[0]).total_seconds()
    assert 4.0 <= gap <= 7.5, gap


def test_a_live_stream_gets_a_workers_print(
    daemon: RunningDaemon, admin: admin_pb2_grpc.MpsdAdminStub
) -> None:
    stream = admin.StreamLogs(admin_pb2.StreamLogsRequest(model="chatty", replay=1, follow=True), timeout=60)
    assert next(stream).replayed  # the subscription is in place from here on
    infer(daemon, "chatty", 7)
    event = next(e for e in stream if e.kind == "stdout" and e.message == "marker 7")
    stream.cancel()
    assert not event.replayed
    assert (event.model, event.version, event.pid) == ("chatty", 1, pid_of(admin, "chatty"))
    assert event.fields["source"] == "worker.stdout"


def test_replay_holds_an_exception_raised_by_the_model(
    daemon: RunningDaemon, admin: admin_pb2_grpc.MpsdAdminStub
) -> None:
    with pytest.raises(InferenceServerException, match="boom 5"):
        infer(daemon, "raiser", 5)
    events = [e for e in replay(admin, model="raiser", kinds=["request"]) if "boom 5" in e.fields["error"]]
    assert len(events) == 1
    [event] = events
    assert event.replayed and event.level == "warning"
    assert (event.model, event.pid) == ("raiser", pid_of(admin, "raiser"))
    assert event.fields["code"] == "INTERNAL"


def test_a_worker_crash_is_an_event(daemon: RunningDaemon, admin: admin_pb2_grpc.MpsdAdminStub) -> None:
    pid = pid_of(admin, "victim")
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: pid_of(admin, "victim") not in (0, pid), 60, "the worker to restart")
    events = replay(admin, model="victim", kinds=["crash", "device"])
    [crash_at] = [i for i, e in enumerate(events) if e.kind == "crash"]
    crash = events[crash_at]
    assert (crash.pid, crash.level, crash.message) == (pid, "error", "worker died")
    assert "SIGKILL" in crash.fields["exit"]
    assert [e.message for e in events[crash_at + 1 :] if e.pid != pid] == ["worker ready"]


def test_level_and_kind_filters_and_bad_requests(admin: admin_pb2_grpc.MpsdAdminStub) -> None:
    assert {e.level for e in replay(admin, level="warning")} <= {"warning", "error", "critical"}
    device = replay(admin, kinds=["device"])
    assert device and all(
        e.fields["device"] in ("cpu", "cuda", "mps") and float(e.fields["load_ms"]) >= 0 for e in device
    )
    assert len(replay(admin)) > len(device)
    with pytest.raises(grpc.RpcError) as err:
        replay(admin, level="loud")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_client_that_stops_reading_never_blocks_inference(daemon: RunningDaemon) -> None:
    # No BDP probing: the stream's flow-control window stays small, so the daemon's queue must absorb.
    with grpc.insecure_channel(daemon.address, options=[("grpc.http2.bdp_probe", 0)]) as channel:
        admin = admin_pb2_grpc.MpsdAdminStub(channel)
        stream = admin.StreamLogs(
            admin_pb2.StreamLogsRequest(model="flood", replay=1, follow=True), timeout=120
        )
        assert next(stream).replayed
        for i in range(150):  # 6000 events for a stream nobody reads; every request must succeed
            infer(daemon, "flood", i + 1)
        dropped = 0
        for event in stream:  # reading again: the first event after the gap says how many were lost
            dropped = event.dropped
            if dropped:
                break
        stream.cancel()
    assert dropped > 0


def test_log_settings_change_the_level_at_runtime(
    daemon: RunningDaemon, admin: admin_pb2_grpc.MpsdAdminStub
) -> None:
    c = daemon.client
    assert "logging" in c.get_server_metadata(as_json=True)["extensions"]
    settings = c.get_log_settings(as_json=True)["settings"]
    assert settings["log_info"] == {"bool_param": True}
    assert settings["log_verbose_level"] == {"uint32_param": 0}

    changed = c.update_log_settings({"log_info": False}, as_json=True)["settings"]
    assert changed["log_info"] == {"bool_param": False}
    assert changed["log_warning"] == {"bool_param": True}
    infer(daemon, "chatty", 11)  # at warning level the worker's print reaches the stream, not stderr
    wait_for(lambda: any(e.message == "marker 11" for e in replay(admin, model="chatty")), 30, "marker 11")
    c.update_log_settings({"log_verbose_level": 1})
    verbose = c.get_log_settings(as_json=True)["settings"]
    assert verbose["log_verbose_level"] == {"uint32_param": 1}
    infer(daemon, "chatty", 12)
    c.update_log_settings({"log_verbose_level": 0, "log_info": True})
    wait_for(lambda: "marker 12" in daemon.log(), 30, "the print at debug level")
    assert "marker 11" not in daemon.log()

    for bad in ({"log_file": "/tmp/mpsd.log"}, {"no_such_setting": True}, {"log_info": None}):
        with pytest.raises(InferenceServerException) as err:
            c.update_log_settings(bad)
        assert err.value.status() == "StatusCode.INVALID_ARGUMENT", bad
    assert c.get_log_settings(as_json=True)["settings"]["log_info"] == {"bool_param": True}


@pytest.mark.skipif(torch.cuda.is_available() or torch.backends.mps.is_available(), reason="a GPU is present")
def test_the_daemon_logs_which_devices_kind_auto_passed_over(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    models.add_sub(repo, instance_group=[{"kind": "KIND_AUTO", "count": 1}])
    with serving(repo, tmp_path / "daemon.log") as daemon:
        events = [json.loads(line) for line in daemon.log().splitlines() if line.startswith("{")]
    (ready,) = [e for e in events if e["event"] == "worker ready"]
    assert ready["device"] == "cpu"
    assert set(ready["skipped_devices"]) == {"mps", "cuda"}, ready
