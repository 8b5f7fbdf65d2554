"""`mpsd status|logs|health|reload`: small gRPC clients of a running daemon.

They ask the daemon rather than read its files, because only the daemon knows what actually runs: a
model may be on disk and still failing to load, a worker may be restarting. A failed call raises
grpc.RpcError; the command line (mpsd.cli.ops) turns it into one line on stderr and a distinct exit status.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import grpc

from mpsd.connect import open_channel
from mpsd.tools.common import table


def _admin(channel: grpc.Channel) -> Any:
    from mpsd.proto import admin_pb2_grpc

    return admin_pb2_grpc.MpsdAdminStub(channel)  # type: ignore[no-untyped-call]


# ---- status ----------------------------------------------------------------------------------------


def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit in ("B", "KiB") else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _duration(seconds: float) -> str:
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def worker_dict(w: Any) -> dict[str, Any]:
    """A ListWorkers entry as plain JSON types (int64 stays a number, absent optionals become null)."""
    return {
        "model": w.model,
        "version": w.version,
        "instance": w.instance,
        "pid": w.pid or None,
        "instance_kind": w.instance_kind,
        "device": {
            "kind": w.device.kind or None,
            "index": w.device.index if w.device.HasField("index") else None,
            "name": w.device.name or None,
        },
        "memory_fraction": w.memory_fraction if w.HasField("memory_fraction") else None,
        "state": w.state,
        "version_state": w.version_state,
        "restarts": w.restarts,
        "uptime_s": round(w.uptime_s, 1),
        "last_exit": w.last_exit or None,
        "last_error": w.last_error or None,
        "memory": dict(w.memory),
        "skipped_devices": dict(w.skipped_devices),
    }


def _device_memory(worker: dict[str, Any]) -> str:
    memory = worker["memory"]
    kind = worker["device"]["kind"]
    used, total = {
        "cuda": ("reserved_bytes", "total_bytes"),
        "mps": ("driver_allocated_bytes", "recommended_max_bytes"),
    }.get(kind, ("", ""))
    if used not in memory:
        return "-"
    return f"{_bytes(memory[used])} / {_bytes(memory.get(total))}"


def render_status(data: dict[str, Any]) -> str:
    """`mpsd status` as text: the models, then a table for each other part of the status that has rows."""
    models = data["models"]
    ready = len({m["name"] for m in models if m["state"] == "READY"})
    parts = [
        f"daemon {data['address']}: {ready} of {len({m['name'] for m in models})} models ready",
        "",
        table(
            ["MODEL", "VERSION", "STATE", "REASON"],
            [[m["name"], m["version"] or "-", m["state"], m["reason"]] for m in models],
        ),
    ]
    parts += _workers_section(data["workers"])
    parts += _residency_section(data.get("residency") or [], data.get("budgets") or [])
    parts += _device_time_section(data.get("device_compute") or [])
    parts += _fronts_section(data.get("fronts") or [])
    return "\n".join(parts)


def _workers_section(workers: list[dict[str, Any]]) -> list[str]:
    """The workers' table, then why a worker is not on a device it could have used (CPU not counted)."""
    if not workers:
        return []
    rows = []
    for w in workers:
        device = w["device"]
        where = device["kind"] or "-"
        if device["index"] is not None:
            where += f":{device['index']}"
        fraction = w["memory_fraction"]
        rows.append(
            [
                f"{w['model']}/{w['version']}#{w['instance']}",
                str(w["pid"] or "-"),
                where,
                "-" if fraction is None else f"{fraction:g}",
                w["state"],
                str(w["restarts"]),
                _duration(w["uptime_s"]) if w["uptime_s"] else "-",
                _bytes(w["memory"].get("rss_bytes")),
                _device_memory(w),
                w["last_exit"] or "-",
            ]
        )
    headers = ["WORKER", "PID", "DEVICE", "FRACTION", "STATE", "RESTARTS", "UPTIME", "RSS", "DEVICE MEM"]
    return [
        "",
        table([*headers, "LAST EXIT"], rows),
        *(
            f"{w['model']}/{w['version']}#{w['instance']} is not on {skipped}: {why}"
            for w in workers
            for skipped, why in w.get("skipped_devices", {}).items()
            if skipped != "cpu"
        ),
    ]


def _residency_section(residency: list[dict[str, Any]], budgets: list[dict[str, Any]]) -> list[str]:
    """Which models are resident and what they hold, then each device's budget (shown only beside them)."""
    if not residency:
        return []
    rows = [
        [
            r["model"],
            "yes" if r["resident"] else "no",
            "yes" if r["pinned"] else "no",
            r["load"],
            r["keep_alive"],
            "-" if r["idle_s"] is None else _duration(r["idle_s"]),
            ", ".join(f"{d} {_bytes(n)}" for d, n in sorted(r["footprint"].items())) or "-",
            r["footprint_basis"] or "-",
        ]
        for r in residency
    ]
    headers = ["MODEL", "RESIDENT", "PINNED", "LOAD", "KEEP ALIVE", "IDLE", "FOOTPRINT", "FROM"]
    return [
        "",
        table(headers, rows),
        *(
            f"{b['device']}: {_bytes(b['resident_bytes'])} held of a {_bytes(b['budget_bytes'])} budget"
            for b in budgets
        ),
    ]


def _device_time_section(device: list[dict[str, Any]]) -> list[str]:
    if not device:
        return []
    rows = [
        [d["model"], str(d["version"]), str(d["executions"]), f"{d['ns'] / d['executions'] / 1e6:.3f} ms"]
        for d in device
    ]
    return ["", table(["MODEL", "VERSION", "EXECUTIONS", "DEVICE TIME / EXECUTION"], rows)]


def _fronts_section(fronts: list[dict[str, Any]]) -> list[str]:
    if not fronts:
        return []
    keys = ["index", "pid", "state", "requests", "restarts"]
    rows = [[str(f[k]) for k in keys] + [str(f.get("port") or "shared")] for f in fronts]
    return ["", table(["FRONT", "PID", "STATE", "REQUESTS", "RESTARTS", "PORT"], rows)]


def status(conn: argparse.Namespace, json_output: bool, timeout: float) -> int:
    """Models (RepositoryIndex), workers and fronts (ListWorkers) as tables, or as one JSON document."""
    from mpsd.proto import admin_pb2
    from mpsd.proto import grpc_service_pb2 as kserve
    from mpsd.proto import grpc_service_pb2_grpc as kserve_grpc

    with open_channel(conn) as channel:
        inference = kserve_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
        index = inference.RepositoryIndex(kserve.RepositoryIndexRequest(), timeout=timeout)
        workers = _admin(channel).ListWorkers(admin_pb2.ListWorkersRequest(), timeout=timeout)
    data = {
        "address": conn.address,
        "models": [
            {"name": m.name, "version": m.version, "state": m.state, "reason": m.reason} for m in index.models
        ],
        "workers": [worker_dict(w) for w in workers.workers],
        "fronts": [
            {
                "index": f.index,
                "pid": f.pid,
                "state": f.state,
                "requests": f.requests,
                "restarts": f.restarts,
                "port": f.port,
            }
            for f in workers.fronts
        ],
        "residency": [
            {
                "model": r.model,
                "resident": r.resident,
                "pinned": r.pinned,
                "load": r.load,
                "keep_alive": r.keep_alive,
                "idle_s": round(r.idle_s, 1) if r.HasField("idle_s") else None,
                "footprint": dict(r.footprint),
                "footprint_basis": r.footprint_basis or None,
            }
            for r in workers.residency
        ],
        "budgets": [
            {
                "device": b.device,
                "budget_bytes": b.budget_bytes if b.HasField("budget_bytes") else None,
                "resident_bytes": b.resident_bytes,
            }
            for b in workers.budgets
        ],
        # The device's own compute time per version (CUDA, MPS); versions on the CPU have none.
        "device_compute": [
            {"model": d.model, "version": d.version, "executions": d.executions, "ns": d.ns}
            for d in workers.device_compute
        ],
    }
    print(json.dumps(data, indent=2) if json_output else render_status(data))
    return 0


# ---- logs ------------------------------------------------------------------------------------------


def event_dict(event: Any) -> dict[str, Any]:
    return {
        "seq": event.seq,
        "time": event.time,
        "level": event.level,
        "kind": event.kind,
        "message": event.message,
        "model": event.model or None,
        "version": event.version or None,
        "pid": event.pid or None,
        "worker": event.worker or None,
        "fields": dict(event.fields),
        "dropped": event.dropped,
    }


def format_event(event: Any) -> str:
    """One readable line: time, level, kind, where (model/version, pid), message, other fields."""
    where = ""
    if event.model:
        where = f"{event.model}/{event.version}" if event.version else event.model
    if event.pid:
        where = f"{where} pid {event.pid}".strip()
    extras = "".join(f" {k}={v}" for k, v in sorted(event.fields.items()) if k != "source")
    location = f" [{where}]" if where else ""
    return f"{event.time} {event.level:<7} {event.kind:<12}{location} {event.message}{extras}"


def logs(
    conn: argparse.Namespace,
    model: str | None,
    level: str | None,
    kinds: list[str] | None,
    replay: int,
    follow: bool,
    json_output: bool,
    timeout: float,
) -> int:
    """Print the daemon's events (the last `replay` first), one per line; with `follow`, until Ctrl-C."""
    from mpsd.proto import admin_pb2

    request = admin_pb2.StreamLogsRequest(
        model=model or "",
        level=level or ("" if kinds else "info"),
        kinds=kinds or [],
        replay=replay,
        follow=follow,
    )
    with open_channel(conn) as channel:
        stream = _admin(channel).StreamLogs(request, timeout=None if follow else timeout)
        try:
            for event in stream:
                if event.dropped:
                    print(f"... {event.dropped} events dropped (this reader was too slow)", file=sys.stderr)
                print(json.dumps(event_dict(event)) if json_output else format_event(event), flush=True)
        except KeyboardInterrupt:
            stream.cancel()
    return 0


# ---- health and reload -----------------------------------------------------------------------------


def health(conn: argparse.Namespace, service: str, timeout: float) -> int:
    """The standard health check of the daemon ("") or of one model or service: 0 when SERVING."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    what = f"'{service}'" if service else "daemon"
    with open_channel(conn) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            if exc.code() is not grpc.StatusCode.NOT_FOUND:  # type: ignore[attr-defined]
                raise
            print(f"{what}: NOT_FOUND (the daemon has no model or service of that name)")
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{what}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def reload(conn: argparse.Namespace, timeout: float) -> int:
    """Ask the daemon to reconcile with its repository now and print what it did."""
    from mpsd.proto import admin_pb2

    with open_channel(conn) as channel:
        reply = _admin(channel).Reload(admin_pb2.ReloadRequest(), timeout=timeout)
    print(reply.summary)
    return 0
