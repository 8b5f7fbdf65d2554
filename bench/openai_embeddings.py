"""OpenAI's `/v1/embeddings` against the same model over KServe's HTTP and gRPC protocols, on one daemon.

Two embeddings models, both batched (`max_batch_size: 16`, dynamic batching without a queue delay), one
sentence per request:

- `bert`: the tests' real text model (tests/text_models.py): a WordPiece tokenizer and a small BERT
  (2 layers, hidden size 32) on one intra-op thread, with a token count beside each embedding;
- `bytes`: the tests' byte-count embeddings (tests/openai_models.py), nearly no compute, so that what the
  protocols cost shows plainly.

Each is called four ways, the same sentence and outputs: KServe gRPC (`ModelInfer`, BYTES input as raw
contents), KServe HTTP (binary tensor data in and out), OpenAI with `encoding_format: base64` (what
OpenAI's Python library asks for unless told) and with `float` (JSON numbers). Requests are built once in
advance and sent by bench/loadgen.py's client processes (raw sockets for HTTP, a raw stub for gRPC), one
request in flight, then 16 from one client process, sides in turn, interleaved rounds (bench/README.md,
"Method"). The target: the OpenAI path costs no more than 1.2x the KServe HTTP one (p50 at one client, and
the throughput at 16 in flight no lower than 1/1.2 of it).

Usage: python -m bench.openai_embeddings --out bench/results --name openai-embeddings-cpu
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import socket
import statistics
import struct
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import Server, machine_info, start_mpsd
from bench.loadgen import ClientPool, _http_call
from bench.run import measure
from mpsd.proto import grpc_service_pb2 as pb
from tests import openai_models, text_models

SENTENCE = "the quick brown fox jumps over the lazy dog"
SIDES = ("grpc", "kserve_http", "openai", "openai_float")
TARGET = 1.2
BERT_BODY = """
texts = inputs['TEXT'].reshape(-1)
return {'EMBEDDING': self.embed(texts), 'TOKENS': self.embed.tokens(texts).unsqueeze(1)}
"""


def build_repo(repo: Path) -> None:
    batching = {"max_batch_size": 16, "dynamic_batching": {"max_queue_delay_microseconds": 0}}
    text_models.embedder(
        repo,
        "bert",
        {
            "backend": "python",
            **batching,
            "input": [{"name": "TEXT", "data_type": "TYPE_STRING", "dims": [1]}],
            "output": [
                {"name": "EMBEDDING", "data_type": "TYPE_FP32", "dims": [text_models.HIDDEN]},
                {"name": "TOKENS", "data_type": "TYPE_INT64", "dims": [1]},
            ],
            "instance_group": [{"kind": "KIND_CPU"}],
            "parameters": {"intra_op_thread_count": "1"},
            "openai": {
                "task": "embeddings",
                "input": "TEXT",
                "output": "EMBEDDING",
                "usage_output": "TOKENS",
            },
        },
        BERT_BODY,
    )
    openai_models.byte_counts(repo, "bytes", **{**batching, "max_batch_size": 16})


def outputs_of(model: str) -> list[str]:
    return ["EMBEDDING", "TOKENS"] if model == "bert" else ["EMBEDDING"]


def grpc_request(model: str) -> bytes:
    request = pb.ModelInferRequest(model_name=model)
    request.inputs.add(name="TEXT", datatype="BYTES", shape=[1, 1])
    request.raw_input_contents.append(struct.pack("<I", len(SENTENCE)) + SENTENCE.encode())
    for name in outputs_of(model):
        request.outputs.add(name=name)
    return bytes(request.SerializeToString())


def http(address: str, path: str, body: bytes, content_type: str, extra: str = "") -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {address}\r\nContent-Type: {content_type}\r\n{extra}"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def kserve_http_request(model: str, address: str) -> bytes:
    data = struct.pack("<I", len(SENTENCE)) + SENTENCE.encode()
    tensor = {
        "name": "TEXT",
        "shape": [1, 1],
        "datatype": "BYTES",
        "parameters": {"binary_data_size": len(data)},
    }
    wanted = [{"name": n, "parameters": {"binary_data": True}} for n in outputs_of(model)]
    header = json.dumps({"inputs": [tensor], "outputs": wanted}).encode()
    extra = f"Inference-Header-Content-Length: {len(header)}\r\n"
    return http(address, f"/v2/models/{model}/infer", header + data, "application/octet-stream", extra)


def openai_request(model: str, address: str, encoding: str) -> bytes:
    body = json.dumps({"model": model, "input": SENTENCE, "encoding_format": encoding}).encode()
    return http(address, "/v1/embeddings", body, "application/json")


def call_http(address: str, request: bytes) -> bytes:
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        return _http_call(sock, request, bytearray())


def check(server: Server, model: str, requests: dict[str, bytes]) -> None:
    """Every side answers with the same embedding."""
    assert server.http_address is not None
    reply = pb.ModelInferResponse()
    reply.ParseFromString(
        server.channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")(requests["grpc"])
    )
    expected = np.frombuffer(reply.raw_output_contents[0], "<f4")
    kserve = call_http(server.http_address, requests["kserve_http"])
    start = len(kserve) - sum(len(r) for r in reply.raw_output_contents)  # the JSON, then the outputs
    head = json.loads(kserve[:start])
    assert head["outputs"][0]["parameters"]["binary_data_size"] == expected.nbytes, head
    np.testing.assert_array_equal(np.frombuffer(kserve[start : start + expected.nbytes], "<f4"), expected)
    encoded = json.loads(call_http(server.http_address, requests["openai"]))["data"][0]["embedding"]
    np.testing.assert_array_equal(np.frombuffer(base64.b64decode(encoded), "<f4"), expected)
    floats = json.loads(call_http(server.http_address, requests["openai_float"]))["data"][0]["embedding"]
    np.testing.assert_array_equal(np.array(floats, np.float32), expected)


def run_model(args: argparse.Namespace, pool: ClientPool, server: Server, model: str) -> dict[str, Any]:
    assert server.http_address is not None
    requests = {
        "grpc": grpc_request(model),
        "kserve_http": kserve_http_request(model, server.http_address),
        "openai": openai_request(model, server.http_address, "base64"),
        "openai_float": openai_request(model, server.http_address, "float"),
    }
    check(server, model, requests)
    rounds = []
    for r in range(args.rounds):
        row: dict[str, Any] = {"load_average_1m": os.getloadavg()[0]}
        order = list(SIDES[r % len(SIDES) :] + SIDES[: r % len(SIDES)])
        for concurrency in (1, 16):
            for side in order:
                protocol = "grpc" if side == "grpc" else "http"
                key = side if concurrency == 1 else f"{side}_16"
                row[key] = measure(
                    pool, server, requests[side], concurrency, 1, args.duration, args.warmup, protocol
                )
        rounds.append(row)
        print(f"  {model} round {r + 1}: {line(row)}", flush=True)
    return {"model": model, "request_bytes": {k: len(v) for k, v in requests.items()}, "rounds": rounds}


def line(row: dict[str, Any]) -> str:
    one = ", ".join(f"{s} {row[s]['p50_ms']:.3f}" for s in SIDES)
    many = ", ".join(f"{s} {row[s + '_16']['throughput_rps']:.0f}" for s in SIDES)
    return f"p50 ms: {one}; req/s at 16: {many} [load {row['load_average_1m']:.1f}]"


def med(values: list[float]) -> float:
    return float(statistics.median(values))


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """Medians over rounds, and the medians of the per-round ratios."""
    rounds = result["rounds"]
    out: dict[str, Any] = {}
    for side in SIDES:
        out[side] = {
            "p50_ms": med([r[side]["p50_ms"] for r in rounds]),
            "p99_ms": med([r[side]["p99_ms"] for r in rounds]),
            "mean_ms": med([r[side]["mean_ms"] for r in rounds]),
            "throughput_16": med([r[side + "_16"]["throughput_rps"] for r in rounds]),
            "server_cpu_us_1": med([r[side]["cpu_us_per_request"]["server"] for r in rounds]),
            "server_cpu_us_16": med([r[side + "_16"]["cpu_us_per_request"]["server"] for r in rounds]),
        }
    for side in ("openai", "openai_float", "grpc"):
        out[f"p50_{side}_over_kserve_http"] = med(
            [r[side]["p50_ms"] / r["kserve_http"]["p50_ms"] for r in rounds]
        )
        out[f"mean_{side}_over_kserve_http"] = med(
            [r[side]["mean_ms"] / r["kserve_http"]["mean_ms"] for r in rounds]
        )
        out[f"throughput_kserve_http_over_{side}"] = med(
            [r["kserve_http_16"]["throughput_rps"] / r[side + "_16"]["throughput_rps"] for r in rounds]
        )
    return out


def markdown(results: dict[str, Any]) -> str:
    machine = results["machine"]
    where = f"{machine['cpu']}, {machine['logical_cores']} CPUs, Python {machine['python']}"
    text = [
        "# /v1/embeddings against KServe HTTP and gRPC on the same model",
        "",
        f"Machine: {where}, torch {machine['torch']}; load average at start {results['load_start']:.1f}, "
        f"at end {results['load_end']:.1f}. {results['rounds']} rounds of {results['duration_s']:g} s per "
        "side (bench/openai_embeddings.py). Medians over rounds; ratios are medians of per-round ratios.",
        "",
    ]
    for model, result in results["models"].items():
        s = result["summary"]
        text += [
            f"## {model}",
            "",
            "| side | p50 ms (1 client) | p99 ms | mean ms | req/s (16 in flight) "
            "| daemon CPU us/req (1 / 16) |",
            "|---|---|---|---|---|---|",
        ]
        for side in SIDES:
            v = s[side]
            text.append(
                f"| {side} | {v['p50_ms']:.3f} | {v['p99_ms']:.3f} | {v['mean_ms']:.3f} | "
                f"{v['throughput_16']:.0f} | {v['server_cpu_us_1']:.0f} / {v['server_cpu_us_16']:.0f} |"
            )
        p50, tput = s["p50_openai_over_kserve_http"], s["throughput_kserve_http_over_openai"]
        float_p50, float_tput = (
            s["p50_openai_float_over_kserve_http"],
            s["throughput_kserve_http_over_openai_float"],
        )
        verdict = "met" if p50 <= TARGET and tput <= TARGET else "missed"
        text += [
            "",
            f"OpenAI (base64) / KServe HTTP: p50 {p50:.2f}x, mean {s['mean_openai_over_kserve_http']:.2f}x; "
            f"KServe HTTP / OpenAI throughput at 16 in flight {tput:.2f}x. With `float`: p50 "
            f"{float_p50:.2f}x, throughput {float_tput:.2f}x. gRPC / KServe HTTP p50 "
            f"{s['p50_grpc_over_kserve_http']:.2f}x. Target (<= {TARGET}x on both): {verdict}.",
            "",
        ]
    return "\n".join(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--name", default="openai-embeddings-cpu")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--duration", type=float, default=3.0)
    parser.add_argument("--warmup", type=float, default=0.5)
    parser.add_argument("--models", default="bert,bytes")
    parser.add_argument("--quick", action="store_true", help="2 short rounds: checks that it runs")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.duration, args.warmup = 2, 1.0, 0.2
    results: dict[str, Any] = {
        "machine": machine_info(),
        "load_start": os.getloadavg()[0],
        "rounds": args.rounds,
        "duration_s": args.duration,
        "models": {},
    }
    with tempfile.TemporaryDirectory(prefix="mpsd-bench-openai-") as tmp:
        work = Path(tmp)
        build_repo(work / "repo")
        server = start_mpsd(work / "repo", work)
        pool = ClientPool(1)
        try:
            server.wait_ready()
            for model in args.models.split(","):
                result = run_model(args, pool, server, model)
                result["summary"] = summary(result)
                results["models"][model] = result
        finally:
            pool.close()
            server.stop()
    results["load_end"] = os.getloadavg()[0]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(results, indent=1))
    (args.out / f"{args.name}.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
