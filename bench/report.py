"""Medians, ratios, verdicts against the targets, and the markdown summary of a benchmark run."""

from __future__ import annotations

import statistics
from typing import Any

# scenario -> (what is compared, comparison, target)
TARGETS: dict[str, list[tuple[str, str, float]]] = {
    "1": [("p50 mpsd / floor", "<=", 1.2)],
    "2": [("throughput mpsd / floor", ">=", 0.85)],
    "3": [("p50 mpsd / floor", "<=", 1.2)],
    "4": [("throughput batching on / in-process", ">=", 0.9), ("throughput batching on / off", ">=", 2.0)],
    "5": [("throughput mpsd / in-process", ">=", 0.9)],
    "7": [("p50 HTTP / gRPC, one client", "<=", 1.3)],
}

# The speed work's targets, with MLServer and Triton as peers (scenarios 1-3): scenario -> (what, comparison,
# target, summary key, the peer the ratio needs or None). Each is judged against both of MLServer's
# configurations that ran (bench/mlserver_peer.py) and against Triton (bench/triton_peer.py), where it ran.
PEER_TARGETS: dict[str, list[tuple[str, str, float, str, str | None]]] = {
    "1": [
        ("mean latency mpsd / MLServer (in-process)", "<=", 0.9, "ratio_mean_mpsd_mlserver", "mlserver"),
        (
            "mean latency mpsd / MLServer (1 parallel worker)",
            "<=",
            0.9,
            "ratio_mean_mpsd_mlserver_w1",
            "mlserver_w1",
        ),
        ("p50 latency mpsd / Triton (python backend)", "<=", 1.3, "ratio_p50_mpsd_triton", "triton"),
    ],
    "2": [
        ("throughput mpsd / MLServer (in-process)", ">=", 1.3, "ratio_throughput_mpsd_mlserver", "mlserver"),
        (
            "throughput mpsd / MLServer (1 parallel worker)",
            ">=",
            1.3,
            "ratio_throughput_mpsd_mlserver_w1",
            "mlserver_w1",
        ),
        ("throughput mpsd / floor (speed-work target)", ">=", 0.6, "ratio_throughput_mpsd_floor", None),
        ("throughput mpsd / Triton (python backend)", ">=", 0.5, "ratio_throughput_mpsd_triton", "triton"),
    ],
    "3": [("p50 floor / mpsd (mpsd's speed against the floor's)", ">=", 0.85, "ratio_p50_floor_mpsd", None)],
}
PEERS = ("mlserver", "mlserver_w1", "triton", "mpsd_before")
PEER_LABELS = {
    "mlserver": "MLServer (in-process)",
    "mlserver_w1": "MLServer (1 parallel worker)",
    "triton": "Triton (python backend)",
    "mpsd_before": "mpsd before (--baseline-tree)",
}


def med(values: list[float]) -> float:
    values = [v for v in values if v == v]  # drop NaN
    return float(statistics.median(values)) if values else float("nan")


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


# ---- console lines -------------------------------------------------------------------------------------


def latency_line(row: dict[str, Any]) -> str:
    m, f, i = row["mpsd"], row["floor"], row["inprocess"]
    return (
        f"p50 mpsd {m['p50_ms']:.3f} ms, floor {f['p50_ms']:.3f} ms, in-process {i['p50_ms']:.4f} ms "
        f"(x{_ratio(m['p50_ms'], f['p50_ms']):.2f}); p99 mpsd {m['p99_ms']:.3f}, floor {f['p99_ms']:.3f}"
        + "".join(f"; {p} p50 {row[p]['p50_ms']:.3f} mean {row[p]['mean_ms']:.3f}" for p in PEERS if p in row)
        + f" [load {row['load_average_1m']:.1f}]"
    )


def throughput_line(row: dict[str, Any]) -> str:
    m, f = row["mpsd"], row["floor"]
    return (
        f"mpsd {m['throughput_rps']:.0f}/s, floor {f['throughput_rps']:.0f}/s "
        f"(x{_ratio(m['throughput_rps'], f['throughput_rps']):.2f})"
        + "".join(f", {p} {row[p]['throughput_rps']:.0f}/s" for p in PEERS if p in row)
        + f" [load {row['load_average_1m']:.1f}]"
    )


def http_line(row: dict[str, Any]) -> str:
    g, h, g16, h16 = row["grpc"], row["http"], row["grpc_16"], row["http_16"]
    return (
        f"p50 HTTP {h['p50_ms']:.3f} ms, gRPC {g['p50_ms']:.3f} ms "
        f"(x{_ratio(h['p50_ms'], g['p50_ms']):.2f}); "
        f"16 in flight HTTP {h16['throughput_rps']:.0f}/s, gRPC {g16['throughput_rps']:.0f}/s "
        f"[load {row['load_average_1m']:.1f}]"
    )


def batching_line(row: dict[str, Any]) -> str:
    on, off, inp = row["batched"], row["unbatched"], row["inprocess"]
    return (
        f"on {on['throughput_rps']:.0f}/s (p99 {on['p99_ms']:.1f} ms, mean batch "
        f"{mean_batch(on['batches']):.1f}), off {off['throughput_rps']:.0f}/s (p99 {off['p99_ms']:.1f} ms), "
        f"in-process {inp['throughput_rps']:.0f}/s [load {row['load_average_1m']:.1f}]"
    )


def startup_line(run: dict[str, Any]) -> str:
    workers = run["children"]
    return (
        f"ready in {run['ready_s']:.2f} s; daemon RSS {mib(run['server']['rss_bytes']):.0f} MiB, "
        f"{len(workers)} worker(s) RSS {mib(sum(w['rss_bytes'] for w in workers)):.0f} MiB "
        f"(USS {mib(sum(w['uss_bytes'] for w in workers)):.0f} MiB)"
    )


def mib(n: float) -> float:
    return n / 2**20


def _cpu_list(cpus: list[int]) -> str:
    """`0-7` for a contiguous range, else a comma-separated list."""
    if cpus and cpus == list(range(cpus[0], cpus[-1] + 1)) and len(cpus) > 1:
        return f"{cpus[0]}-{cpus[-1]}"
    return ",".join(str(c) for c in cpus)


def mean_batch(batches: dict[Any, dict[str, int]]) -> float:
    rows = sum(int(size) * s["count"] for size, s in batches.items())
    execs = sum(s["count"] for s in batches.values())
    return rows / execs if execs else 0.0


# ---- summaries -----------------------------------------------------------------------------------------


def summarize_latency(s: dict[str, Any]) -> dict[str, Any]:
    rounds = s["rounds"]
    out: dict[str, Any] = {}
    for who in ("mpsd", "floor", "inprocess"):
        out[who] = {k: med([r[who][k] for r in rounds]) for k in ("p50_ms", "p99_ms", "mean_ms")}
    hop = "floor_hop" in rounds[0]
    peers = [p for p in PEERS if p in rounds[0]]
    for who in ("mpsd", "floor", *(["floor_hop"] if hop else []), *peers):
        out[who] = {k: med([r[who][k] for r in rounds]) for k in ("p50_ms", "p99_ms", "mean_ms")}
        out[who]["cpu_us_per_request"] = {
            k: med([r[who]["cpu_us_per_request"][k] for r in rounds])
            for k in ("server", "workers", "clients")
        }
    if hop:
        out["ratio_p50_mpsd_floor_hop"] = med(
            [_ratio(r["mpsd"]["p50_ms"], r["floor_hop"]["p50_ms"]) for r in rounds]
        )
    out["ratio_p50_mpsd_floor"] = med([_ratio(r["mpsd"]["p50_ms"], r["floor"]["p50_ms"]) for r in rounds])
    out["ratio_p99_mpsd_floor"] = med([_ratio(r["mpsd"]["p99_ms"], r["floor"]["p99_ms"]) for r in rounds])
    out["ratio_p50_mpsd_inprocess"] = med(
        [_ratio(r["mpsd"]["p50_ms"], r["inprocess"]["p50_ms"]) for r in rounds]
    )
    out["added_p50_ms_over_floor"] = out["mpsd"]["p50_ms"] - out["floor"]["p50_ms"]
    out["ratio_p50_floor_mpsd"] = med([_ratio(r["floor"]["p50_ms"], r["mpsd"]["p50_ms"]) for r in rounds])
    for p in peers:
        for k in ("p50", "mean", "p99"):
            out[f"ratio_{k}_mpsd_{p}"] = med([_ratio(r["mpsd"][f"{k}_ms"], r[p][f"{k}_ms"]) for r in rounds])
    return out


def summarize_throughput(s: dict[str, Any]) -> dict[str, Any]:
    rounds = s["rounds"]
    out: dict[str, Any] = {}
    hop = "floor_hop" in rounds[0]
    peers = [p for p in PEERS if p in rounds[0]]
    for who in ("mpsd", "floor", *(["floor_hop"] if hop else []), *peers):
        out[who] = {k: med([r[who][k] for r in rounds]) for k in ("throughput_rps", "p50_ms", "p99_ms")}
        out[who]["cpu_us_per_request"] = {
            k: med([r[who]["cpu_us_per_request"][k] for r in rounds])
            for k in ("server", "workers", "clients")
        }
    if hop:
        out["ratio_throughput_mpsd_floor_hop"] = med(
            [_ratio(r["mpsd"]["throughput_rps"], r["floor_hop"]["throughput_rps"]) for r in rounds]
        )
    out["ratio_throughput_mpsd_floor"] = med(
        [_ratio(r["mpsd"]["throughput_rps"], r["floor"]["throughput_rps"]) for r in rounds]
    )
    for p in peers:
        out[f"ratio_throughput_mpsd_{p}"] = med(
            [_ratio(r["mpsd"]["throughput_rps"], r[p]["throughput_rps"]) for r in rounds]
        )
    if "batches" in rounds[0]["mpsd"]:  # results from before the batcher's sizes were recorded have none
        merged: dict[str, dict[str, int]] = {}
        for r in rounds:
            for size, b in r["mpsd"]["batches"].items():
                merged.setdefault(str(size), {"count": 0})["count"] += b["count"]
        out["mpsd"]["mean_batch"] = mean_batch(merged)
    return out


def summarize_batching(s: dict[str, Any]) -> dict[str, Any]:
    rounds = s["rounds"]
    out: dict[str, Any] = {}
    for who in ("batched", "unbatched"):
        out[who] = {k: med([r[who][k] for r in rounds]) for k in ("throughput_rps", "p50_ms", "p99_ms")}
        out[who]["cpu_us_per_request"] = {
            k: med([r[who]["cpu_us_per_request"][k] for r in rounds])
            for k in ("server", "workers", "clients")
        }
    out["inprocess"] = {
        "throughput_rps": med([r["inprocess"]["throughput_rps"] for r in rounds]),
        "throughput_rps_by_openmp": {
            label: med([r["inprocess"]["throughput_rps_by_openmp"][label] for r in rounds])
            for label in rounds[0]["inprocess"]["throughput_rps_by_openmp"]
        },
        "batch1_throughput_rps": med([r["inprocess"]["batch1_throughput_rps"] for r in rounds]),
    }
    sizes: dict[int, dict[str, int]] = {}
    for r in rounds:
        for size, st in r["batched"]["batches"].items():
            acc = sizes.setdefault(int(size), {"count": 0, "infer_ns": 0})
            acc["count"] += st["count"]
            acc["infer_ns"] += st["infer_ns"]
    out["batch_sizes"] = {size: sizes[size]["count"] for size in sorted(sizes)}
    out["mean_batch"] = mean_batch(sizes)
    top = max(sizes, key=lambda k: sizes[k]["count"]) if sizes else 0
    if top:
        inproc = med([r["inprocess"]["seconds_by_batch"]["best"].get(top, float("nan")) for r in rounds])
        out["most_common_batch"] = {
            "size": top,
            "worker_infer_ms": sizes[top]["infer_ns"] / sizes[top]["count"] / 1e6,
            "inprocess_ms": inproc * 1e3,
        }
    out["ratio_batched_inprocess"] = med(
        [_ratio(r["batched"]["throughput_rps"], r["inprocess"]["throughput_rps"]) for r in rounds]
    )
    out["ratio_batched_unbatched"] = med(
        [_ratio(r["batched"]["throughput_rps"], r["unbatched"]["throughput_rps"]) for r in rounds]
    )
    return out


def _processes(run: dict[str, Any]) -> list[dict[str, int]]:
    """The daemon, its workers and its front processes, as recorded by Server.memory()."""
    return [run["server"], *run["children"], *run.get("fronts", [])]


def summarize_startup(s: dict[str, Any]) -> dict[str, Any]:
    by_models: dict[int, dict[str, Any]] = {}
    for n in sorted({r["models"] for r in s["runs"]}):
        runs = [r for r in s["runs"] if r["models"] == n]
        by_models[n] = {
            "ready_s": med([r["ready_s"] for r in runs]),
            "daemon_rss_mib": med([mib(r["server"]["rss_bytes"]) for r in runs]),
            "daemon_uss_mib": med([mib(r["server"]["uss_bytes"]) for r in runs]),
            "worker_rss_mib": med([mib(w["rss_bytes"]) for r in runs for w in r["children"]]),
            "worker_uss_mib": med([mib(w["uss_bytes"]) for r in runs for w in r["children"]]),
            "fronts": med([float(len(r.get("fronts", []))) for r in runs]),
            "front_rss_mib": med([mib(f["rss_bytes"]) for r in runs for f in r.get("fronts", [])] or [0.0]),
            "total_rss_mib": med([mib(sum(p["rss_bytes"] for p in _processes(r))) for r in runs]),
            "total_uss_mib": med([mib(sum(p["uss_bytes"] for p in _processes(r))) for r in runs]),
            "workers": med([float(len(r["children"])) for r in runs]),
        }
    out: dict[str, Any] = {"by_models": by_models}
    if len(by_models) > 1:
        lo, hi = min(by_models), max(by_models)
        span = hi - lo
        out["per_added_model"] = {
            k: (by_models[hi][k] - by_models[lo][k]) / span
            for k in ("ready_s", "daemon_rss_mib", "total_rss_mib", "total_uss_mib")
        }
    return out


def summarize_http(s: dict[str, Any]) -> dict[str, Any]:
    rounds = s["rounds"]
    out: dict[str, Any] = {}
    for who in ("grpc", "http", "grpc_16", "http_16"):
        keys = ("p50_ms", "p99_ms", "mean_ms", "throughput_rps")
        out[who] = {k: med([r[who][k] for r in rounds]) for k in keys}
        out[who]["cpu_us_per_request"] = {
            k: med([r[who]["cpu_us_per_request"][k] for r in rounds])
            for k in ("server", "workers", "clients")
        }
    out["ratio_p50_http_grpc"] = med([_ratio(r["http"]["p50_ms"], r["grpc"]["p50_ms"]) for r in rounds])
    out["ratio_throughput_http_grpc_16"] = med(
        [_ratio(r["http_16"]["throughput_rps"], r["grpc_16"]["throughput_rps"]) for r in rounds]
    )
    return out


SUMMARIZERS = {
    "1": summarize_latency,
    "2": summarize_throughput,
    "3": summarize_latency,
    "4": summarize_batching,
    "6": summarize_startup,
    "7": summarize_http,
}


def verdicts(scenarios: dict[str, Any]) -> dict[str, Any]:
    """Each scenario's summary is stored in it; returns target -> value, met, and the margin."""
    out: dict[str, Any] = {}
    for key, s in scenarios.items():
        if key in SUMMARIZERS and ("rounds" in s or "runs" in s):
            s["summary"] = SUMMARIZERS[key](s)
        values = {
            "1": [s.get("summary", {}).get("ratio_p50_mpsd_floor")],
            "2": [s.get("summary", {}).get("ratio_throughput_mpsd_floor")],
            "3": [s.get("summary", {}).get("ratio_p50_mpsd_floor")],
            "4": [
                s.get("summary", {}).get("ratio_batched_inprocess"),
                s.get("summary", {}).get("ratio_batched_unbatched"),
            ],
            "5": [s.get("summary", {}).get("ratio_throughput_mpsd_inprocess")],
            "7": [s.get("summary", {}).get("ratio_p50_http_grpc")],
        }.get(key)
        if values is None:
            continue
        checks = []
        for (what, op, target), value in zip(TARGETS[key], values, strict=True):
            if value is None:
                continue
            met = value <= target if op == "<=" else value >= target
            checks.append({"what": what, "value": round(value, 3), "target": f"{op} {target}", "met": met})
        summary = s.get("summary", {})
        for what, op, target, name, peer in PEER_TARGETS.get(key, []):
            ran = peer is None or any(peer in r for r in s.get("rounds", [])[:1])
            value = summary.get(name)
            if not ran or value is None:
                continue
            met = value <= target if op == "<=" else value >= target
            checks.append(
                {"what": what, "value": round(value, 3), "target": f"{op} {target}", "met": met, "peer": True}
            )
        out[key] = {"checks": checks, "met": all(c["met"] for c in checks)}
    return out


# ---- markdown ------------------------------------------------------------------------------------------


def _verdict_text(check: dict[str, Any]) -> str:
    value, target = check["value"], check["target"]
    if check["met"]:
        return f"met ({value:.2f}, target {target})"
    limit = float(target.split()[1])
    if target.startswith("<="):
        return f"**missed** ({value:.2f}, target {target}: {value / limit:.1f}x over)"
    return f"**missed** ({value:.2f}, target {target}: {100 * (1 - value / limit):.0f}% short)"


def machine_lines(m: dict[str, Any]) -> list[str]:
    lines = [
        f"- CPU: {m['cpu']}, {m['logical_cores']} logical cores ({m['physical_cores']} physical), "
        f"{m['memory_gib']} GiB",
        f"- OS: {m['os']}; Python {m['python']}; torch {m['torch']} ({m['torch_threads']} threads); "
        f"grpcio {m['grpcio']}; protobuf {m['protobuf']}",
    ]
    if m.get("gpu"):
        lines.append(f"- GPU: {m['gpu']} (CUDA {m.get('cuda')})")
    return lines


def _cpu(c: dict[str, float]) -> str:
    return f"{c['server']:.0f} / {c['workers']:.0f} / {c['clients']:.0f}"


def _peer_lines(info: dict[str, Any] | None) -> list[str]:
    if not info:
        return []
    if "skipped" in info:
        return [f"- MLServer: not run ({info['skipped']})."]
    v = info["versions"]
    return [
        f"- MLServer {v['mlserver']} (Python {v['python']}, grpcio {v['grpcio']}, protobuf {v['protobuf']}, "
        f"numpy {v['numpy']}, uvloop {v['uvloop']}), in its own virtual environment; the identity models "
        f"as a custom runtime ({info['runtime']}); {info['settings']}. Two configurations: "
        "parallel_workers 0 (the model in the server's process) and 1 (MLServer's default: one inference "
        "worker process). Its adaptive batching is off (its default).",
    ]


def _triton_lines(info: dict[str, Any] | None) -> list[str]:
    if not info:
        return []
    if "skipped" in info:
        return [f"- Triton: not run ({info['skipped']})."]
    v = info["versions"]
    return [
        f"- Triton Inference Server {v['tritonserver']} (the binary of nvidia-pytriton "
        f"{v['nvidia-pytriton']}; "
        f"its python backend on Python {v['python']}, numpy {v['numpy']}), in its own virtual environment; "
        f"{info['model']}; {info['settings']}.",
    ]


def markdown(results: dict[str, Any]) -> str:
    lines = ["# mpsd overhead benchmark", ""]
    lines += machine_lines(results["machine"])
    la0 = results.get("load_average_at_start", [0, 0, 0])
    la1 = results.get("load_average_at_end", la0)
    st = results["settings"]
    lines += [
        f"- Load average (1 min) at start {la0[0]:.1f}, at end {la1[0]:.1f}: other processes ran on the "
        "machine during the run; the client processes share its cores with the servers.",
        f"- {st['rounds']} interleaved rounds of {st['duration']} s per side "
        f"(after {st['warmup']} s warm-up); figures are medians over rounds, ratios are medians of "
        "the per-round ratios.",
        f"- Load generator: {results.get('load_generator', '')}.",
        f"- mpsd's front_processes: {st.get('front_processes') or 'the default (auto: 0 up to 4 CPUs, else '}"
        + ("" if st.get("front_processes") else "one per 4 CPUs, at most 4)")
        + ".",
        f"- mpsd's event_loop: {st.get('event_loop') or 'the default (asyncio)'}.",
        f"- Run took {results.get('wall_s', 0):.0f} s.",
    ]
    if st.get("mpsd_env"):
        lines.append(f"- Daemon and worker environment: {', '.join(st['mpsd_env'])}.")
    lines += _peer_lines(results.get("mlserver"))
    lines += _triton_lines(results.get("triton"))
    if results.get("baseline"):
        b = results["baseline"]
        lines.append(f"- mpsd before: commit {b['commit']}, run beside this one in scenarios 1-3.")
    lines.append("")
    verdicts_ = results.get("verdicts", {})
    sc = results["scenarios"]
    if verdicts_:
        lines += ["## Targets", "", "| scenario | measure | result |", "|---|---|---|"]
        for key in sorted(verdicts_):
            for check in verdicts_[key]["checks"]:
                if not check.get("peer"):
                    lines.append(f"| {key} | {check['what']} | {_verdict_text(check)} |")
        peer_checks = [(k, c) for k in sorted(verdicts_) for c in verdicts_[k]["checks"] if c.get("peer")]
        if peer_checks:
            lines += [
                "",
                "The speed work's targets (MLServer and Triton as peers; mpsd's speed against the floor's):",
                "",
                "| scenario | measure | result |",
                "|---|---|---|",
            ]
            lines += [f"| {k} | {c['what']} | {_verdict_text(c)} |" for k, c in peer_checks]
        lines.append("")
    for key, title in (
        ("1", "identity FP32[1,16], one client"),
        ("3", "identity FP32[1,3,224,224], one client"),
    ):
        if key not in sc:
            continue
        s = sc[key]["summary"]
        lines += [
            f"## Scenario {key}: {title}",
            "",
            "| | p50 ms | p99 ms | mean ms | CPU us/request (server / workers / client) |",
            "|---|---|---|---|---|",
        ]
        for who in ("mpsd", "floor"):
            w = s[who]
            lines.append(
                f"| {who} | {w['p50_ms']:.3f} | {w['p99_ms']:.3f} | {w['mean_ms']:.3f} | "
                f"{_cpu(w['cpu_us_per_request'])} |"
            )
        for who in ("floor_hop", *PEERS):
            if who not in s:
                continue
            w = s[who]
            label = PEER_LABELS.get(who, "floor + worker hop")
            lines.append(
                f"| {label} | {w['p50_ms']:.3f} | {w['p99_ms']:.3f} | {w['mean_ms']:.3f} | "
                f"{_cpu(w['cpu_us_per_request'])} |"
            )
        i = s["inprocess"]
        lines.append(f"| in-process | {i['p50_ms']:.4f} | {i['p99_ms']:.4f} | {i['mean_ms']:.4f} | |")
        lines += [
            "",
            f"mpsd / floor: p50 x{s['ratio_p50_mpsd_floor']:.2f}, p99 x{s['ratio_p99_mpsd_floor']:.2f}; "
            f"mpsd adds {s['added_p50_ms_over_floor'] * 1e3:.0f} us at p50 over the floor.",
        ]
        if "ratio_p50_mpsd_floor_hop" in s:
            lines.append(f"mpsd / floor with a worker hop: p50 x{s['ratio_p50_mpsd_floor_hop']:.2f}.")
        for p in PEERS:
            if f"ratio_mean_mpsd_{p}" in s:
                lines.append(
                    f"mpsd / {PEER_LABELS[p]}: mean x{s[f'ratio_mean_mpsd_{p}']:.2f}, "
                    f"p50 x{s[f'ratio_p50_mpsd_{p}']:.2f}, p99 x{s[f'ratio_p99_mpsd_{p}']:.2f}."
                )
        lines.append("")
    if "2" in sc:
        s = sc["2"]["summary"]
        lines += [
            "## Scenario 2: identity FP32[1,16], 16 requests in flight",
            "",
            "| | requests/s | p50 ms | p99 ms | CPU us/request (server / workers / client) |",
            "|---|---|---|---|---|",
        ]
        for who in ("mpsd", "floor", "floor_hop", *PEERS):
            if who not in s:
                continue
            w = s[who]
            label = "floor + worker hop" if who == "floor_hop" else PEER_LABELS.get(who, who)
            lines.append(
                f"| {label} | {w['throughput_rps']:.0f} | {w['p50_ms']:.2f} | {w['p99_ms']:.2f} | "
                f"{_cpu(w['cpu_us_per_request'])} |"
            )
        lines += ["", f"mpsd / floor throughput: x{s['ratio_throughput_mpsd_floor']:.2f}"]
        if "ratio_throughput_mpsd_floor_hop" in s:
            lines.append(f"mpsd / floor with a worker hop: x{s['ratio_throughput_mpsd_floor_hop']:.2f}")
        for p in PEERS:
            if f"ratio_throughput_mpsd_{p}" in s:
                lines.append(f"mpsd / {PEER_LABELS[p]}: x{s[f'ratio_throughput_mpsd_{p}']:.2f}")
        if "mean_batch" in s["mpsd"]:
            lines.append(
                f"Requests per model execution in mpsd (dynamic batching, no queue delay): "
                f"{s['mpsd']['mean_batch']:.1f} on average."
            )
        lines.append("")
    if "4" in sc:
        s = sc["4"]["summary"]
        lines += ["## Scenario 4: small CNN (3x64x64) on CPU, 32 clients", ""]
        cpus = sc["4"].get("cpus")
        if cpus and sc["4"].get("model_threads"):
            lines += [
                f"The model ran on CPUs {_cpu_list(cpus['model'])} with {sc['4']['model_threads']} "
                "thread(s), in mpsd's worker and in the in-process reference alike; the daemon, its front "
                f"processes and the load generator ran on CPUs {_cpu_list(cpus['server_and_clients'])}.",
                "",
            ]
        lines += [
            "| | images/s | p50 ms | p99 ms | CPU us/request (server / workers / client) |",
            "|---|---|---|---|---|",
        ]
        for who, label in (("batched", "mpsd, batching on"), ("unbatched", "mpsd, batching off")):
            w = s[who]
            lines.append(
                f"| {label} | {w['throughput_rps']:.0f} | {w['p50_ms']:.1f} | {w['p99_ms']:.1f} | "
                f"{_cpu(w['cpu_us_per_request'])} |"
            )
        lines.append(
            f"| in-process at the batch sizes formed | {s['inprocess']['throughput_rps']:.0f} | | | |"
        )
        lines.append(f"| in-process, batch 1 | {s['inprocess']['batch1_throughput_rps']:.0f} | | | |")
        sizes = ", ".join(f"{k}: {v}" for k, v in s["batch_sizes"].items())
        lines += [
            "",
            f"Batches formed (size: executions, all rounds): {sizes}; mean batch {s['mean_batch']:.1f}.",
        ]
        if "most_common_batch" in s:
            c = s["most_common_batch"]
            lines.append(
                f"Most common batch {c['size']}: {c['worker_infer_ms']:.1f} ms in the worker's model call, "
                f"{c['inprocess_ms']:.1f} ms in-process."
            )
        lines += [
            f"Batching on / in-process: x{s['ratio_batched_inprocess']:.2f}; "
            f"batching on / off: x{s['ratio_batched_unbatched']:.2f}.",
            "",
        ]
    if "7" in sc:
        s = sc["7"]["summary"]
        lines += [
            "## Scenario 7: identity FP32[1,16] on mpsd, HTTP (binary tensor data) vs gRPC",
            "",
            "| | in flight | p50 ms | p99 ms | requests/s | CPU us/request (server / workers / client) |",
            "|---|---|---|---|---|---|",
        ]
        for who, label, n in (
            ("grpc", "gRPC", 1),
            ("http", "HTTP", 1),
            ("grpc_16", "gRPC", 16),
            ("http_16", "HTTP", 16),
        ):
            w = s[who]
            lines.append(
                f"| {label} | {n} | {w['p50_ms']:.3f} | {w['p99_ms']:.3f} | {w['throughput_rps']:.0f} | "
                f"{_cpu(w['cpu_us_per_request'])} |"
            )
        lines += [
            "",
            f"HTTP / gRPC: p50 x{s['ratio_p50_http_grpc']:.2f} with one client; throughput "
            f"x{s['ratio_throughput_http_grpc_16']:.2f} with 16 in flight. HTTP is served by the daemon "
            "itself, front processes or not.",
            "",
        ]
    if "6" in sc:
        s = sc["6"]["summary"]
        lines += [
            "## Scenario 6: start-up and memory",
            "",
            "| models | ServerReady s | daemon RSS MiB | worker RSS MiB (each) | worker USS MiB (each) | "
            "front processes (RSS MiB each) | total RSS MiB | total USS MiB |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for n, b in s["by_models"].items():
            fronts = f"{b.get('fronts', 0):.0f} ({b.get('front_rss_mib', 0):.0f})" if b.get("fronts") else "0"
            lines.append(
                f"| {n} | {b['ready_s']:.2f} | {b['daemon_rss_mib']:.0f} | {b['worker_rss_mib']:.0f} | "
                f"{b['worker_uss_mib']:.0f} | {fronts} | "
                f"{b['total_rss_mib']:.0f} | {b['total_uss_mib']:.0f} |"
            )
        if "per_added_model" in s:
            g = s["per_added_model"]
            lines += [
                "",
                f"Each added model: +{g['ready_s']:.2f} s to ServerReady, +{g['total_rss_mib']:.0f} MiB RSS "
                f"(+{g['total_uss_mib']:.0f} MiB USS), daemon +{g['daemon_rss_mib']:.1f} MiB.",
            ]
        lines.append("")
    profiles = [(k, sc[k]["profile"]) for k in sorted(sc) if "profile" in sc[k]]
    if profiles:
        lines += [
            "## Where the time goes (missed targets)",
            "",
            "py-spy on the daemon and on the model's worker during one more mpsd run of the scenario; main "
            "thread only; busy = samples not waiting in select/sleep. Raw profiles are beside this file.",
            "",
        ]
        for key, prof in profiles:
            for proc, p in prof.items():
                own = "; ".join(f"{f} {v}%" for f, v in p["own"][:8])
                lines.append(
                    f"- scenario {key}, {proc} ({p['file']}): busy {100 * p['busy_share']:.0f}% of the "
                    f"time; own time: {own}"
                )
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    """`python -m bench.report RESULTS.json`: write RESULTS.md again from the figures."""
    import json
    import sys
    from pathlib import Path

    for name in sys.argv[1:]:
        path = Path(name)
        results = json.loads(path.read_text())
        path.with_suffix(".md").write_text(markdown(results))


if __name__ == "__main__":
    main()
