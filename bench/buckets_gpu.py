"""Shape buckets on a GPU: a transformer encoder (bench/models.py's Encoder: 6 layers, d_model 512, 8 heads,
random weights, fp16) fed requests of random lengths, served with `shape_buckets` and CUDA graphs against the
same model without buckets, in one daemon, side by side.

Each request carries one sequence of 16..256 token ids (uniform). With buckets (32, 64, 128, 256) the daemon
pads a batch to the smallest bucket that holds its longest request, makes the attention mask, and the model
runs one recorded CUDA graph per batch size and bucket; requests of different lengths in a bucket share an
execution. Without buckets the lengths are the model's shapes: a batch holds requests of one length only, and
CUDA graphs cannot be recorded (a variable dim). Both: dynamic batching up to 64 with the same queue delay,
one instance. 64 clients (bench/loadgen.py: client processes, each with requests in flight on its own channel,
cycling through the same prepared requests) measure throughput and p50/p99; rounds alternate between the
two models. Before measuring, a few requests of lengths across the buckets go to both models and their
answers are compared (fp16: to 2e-2; the run fails if they differ).

    python -m bench.buckets_gpu --out bench/results/buckets-gpu-h200     # on a CUDA machine
    .venv/bin/python -m bench.buckets_gpu --tiny --device cpu --duration 1 --rounds 1 --out /tmp/bg  # check

Writes OUT.json and OUT.md (machine info included).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import batch_stats, machine_info, start_mpsd, stats_delta, summary_ms
from bench.loadgen import ClientPool, LoadSpec
from bench.models import Encoder, write_model
from mpsd.proto import grpc_service_pb2 as pb

MODELS = ("plain", "buckets")


def configs(args: argparse.Namespace, cuda: bool, width: int) -> dict[str, dict[str, Any]]:
    wire = "TYPE_FP16" if cuda else "TYPE_FP32"
    plain: dict[str, Any] = {
        "backend": "torchscript",
        "max_batch_size": args.max_batch,
        "input": [{"name": "ids", "data_type": "TYPE_INT64", "dims": [-1]}],
        "output": [{"name": "pooled", "data_type": wire, "dims": [width]}],
        "instance_group": [{"kind": "KIND_GPU" if cuda else "KIND_CPU", "count": 1}],
        "dynamic_batching": {"max_queue_delay_microseconds": args.delay_us},
    }
    buckets = {
        **plain,
        "shape_buckets": {"inputs": {"ids": {"dim": 1, "sizes": args.sizes}}, "mask_input": "mask"},
    }
    if cuda and not args.no_graphs:
        buckets["optimization"] = {"cuda": {"graphs": True}}
    return {"plain": plain, "buckets": buckets}


def request(model: str, ids: np.ndarray[Any, Any]) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name=model)
    req.inputs.add(name="ids", datatype="INT64", shape=[1, len(ids)])
    req.raw_input_contents.append(ids.astype("<i8").reshape(1, -1).tobytes())
    return req


def answer(reply: pb.ModelInferResponse) -> np.ndarray[Any, Any]:
    out = reply.outputs[0]
    dtype = {"FP16": "<f2", "FP32": "<f4"}[out.datatype]
    return (
        np.frombuffer(reply.raw_output_contents[0], dtype=dtype).astype(np.float32).reshape(list(out.shape))
    )


def check_answers(stub: Any, lengths: list[int], vocab: int, atol: float) -> dict[str, Any]:
    """The same requests to both models: the largest difference, and whether every answer is within `atol`
    (relative too) of the other."""
    rng = np.random.default_rng(1)
    worst = 0.0
    close = True
    for length in lengths:
        ids = rng.integers(1, vocab, length)
        got = {m: answer(stub.ModelInfer(request(m, ids), timeout=120)) for m in MODELS}
        worst = max(worst, float(np.abs(got["plain"] - got["buckets"]).max()))
        close = close and bool(np.allclose(got["buckets"], got["plain"], rtol=atol, atol=atol))
    return {"lengths": lengths, "max_abs_diff": worst, "tolerance": atol, "equal": close}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="OUT.json and OUT.md are written")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--tiny", action="store_true", help="a 1-layer, d_model 64 encoder (a CPU check)")
    parser.add_argument("--clients", type=int, default=64, help="requests in flight in all (default 64)")
    parser.add_argument("--client-processes", type=int, default=4)
    parser.add_argument("--duration", type=float, default=15.0, help="seconds measured per round")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of load before each round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per model, alternating")
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument(
        "--sizes", default="32,64,128,256", help="the buckets (the last: the longest request)"
    )
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--delay-us", type=int, default=1000, help="the queue delay of both models")
    parser.add_argument("--pool", type=int, default=2048, help="distinct prepared requests the clients cycle")
    parser.add_argument("--no-graphs", action="store_true", help="buckets without CUDA graphs (on CUDA)")
    args = parser.parse_args()
    args.sizes = [int(s) for s in args.sizes.split(",")]
    if args.max_len > args.sizes[-1]:
        parser.error(f"--max-len {args.max_len} is longer than the largest bucket {args.sizes[-1]}")
    device = args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    cuda = device == "cuda"
    layers, width, heads = (1, 64, 2) if args.tiny else (6, 512, 8)
    vocab = 8192
    random.seed(0)
    lengths = [random.randint(args.min_len, args.max_len) for _ in range(args.pool)]
    check_lengths = sorted({args.min_len, *(s - 1 for s in args.sizes), *(s + 1 for s in args.sizes[:-1])})
    check_lengths = [n for n in check_lengths if args.min_len <= n <= args.max_len] + [args.max_len]
    rng = np.random.default_rng(0)
    pools = {
        m: tuple(request(m, rng.integers(1, vocab, n)).SerializeToString() for n in lengths) for m in MODELS
    }
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        torch.manual_seed(0)
        module = Encoder(layers, width, heads, vocab).eval()
        for name, config in configs(args, cuda, width).items():
            write_model(work / "repo", name, module.half() if cuda else module, config)
        server = start_mpsd(work / "repo", work)
        pool = ClientPool(args.client_processes)
        try:
            ready_s = server.wait_ready(600)
            check = check_answers(server.stub, check_lengths, vocab, 2e-2 if cuda else 1e-4)
            print("answers:", check, flush=True)
            per_process = max(1, args.clients // args.client_processes)
            for r in range(args.rounds):
                for model in MODELS if r % 2 == 0 else MODELS[::-1]:
                    spec = LoadSpec(
                        server.address,
                        pools[model][0],
                        per_process,
                        args.duration,
                        args.warmup,
                        requests=pools[model],
                    )
                    before = batch_stats(server, model)
                    result = pool.run(spec)
                    delta = stats_delta(batch_stats(server, model), before)
                    executions = sum(v["count"] for v in delta.values())
                    row = {
                        "round": r,
                        "model": model,
                        "throughput": round(result.throughput, 1),
                        **{k: round(v, 2) for k, v in summary_ms(result.latencies_ns).items()},
                        "errors": result.errors,
                        "first_error": result.first_error,
                        "mean_batch": round(sum(b * v["count"] for b, v in delta.items()) / executions, 2)
                        if executions
                        else 0.0,
                    }
                    rounds.append(row)
                    print(row, flush=True)
        finally:
            pool.close()
            server.stop()
    results = {
        "machine": machine_info(),
        "device": device,
        "model": f"Encoder({layers} layers, d_model {width}, {heads} heads)" + (" tiny" if args.tiny else ""),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "clients": per_process * args.client_processes,
        "ready_s": round(ready_s, 1),
        "answers": check,
        "rounds": rounds,
        "summary": {m: summarize([x for x in rounds if x["model"] == m]) for m in MODELS},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    args.out.with_suffix(".md").write_text(markdown(results))
    print(args.out.with_suffix(".md").read_text())
    if not check["equal"]:
        sys.exit("the two models' answers differ: see answers in the JSON")


def summarize(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Medians over the rounds."""
    return {
        k: round(statistics.median(r[k] for r in rows), 2)
        for k in ("throughput", "p50_ms", "p99_ms", "mean_batch")
    }


def markdown(r: dict[str, Any]) -> str:
    m, s, a = r["machine"], r["settings"], r["answers"]
    plain, buckets = r["summary"]["plain"], r["summary"]["buckets"]
    gain = buckets["throughput"] / plain["throughput"] if plain["throughput"] else float("nan")
    graphs = "CUDA graphs" if r["device"] == "cuda" and not s["no_graphs"] else "no CUDA graphs"
    lines = [
        f"# Shape buckets on {r['device']}: {r['model']}, lengths {s['min_len']}..{s['max_len']}",
        "",
        f"`python -m bench.buckets_gpu --out {s['out']}"
        + (" --tiny" if s["tiny"] else "")
        + "` (settings: see the JSON)",
        "",
        f"- Machine: {m['cpu']}, {m['logical_cores']} logical cores, {m['memory_gib']} GiB; GPU:"
        f" {m.get('gpu')} (CUDA {m.get('cuda')}); torch {m['torch']}; Python {m['python']}",
        f"- {r['clients']} clients ({s['client_processes']} processes), one sequence a request, uniform"
        f" {s['min_len']}..{s['max_len']} tokens; {s['rounds']} rounds of {s['warmup']:g} s warm-up +"
        f" {s['duration']:g} s per model, alternating; medians",
        f"- Both: max_batch_size {s['max_batch']}, queue delay {s['delay_us']} us, one instance. Buckets:"
        f" {s['sizes']}, mask made by the daemon, {graphs}. Without: the lengths as sent, no graphs.",
        f"- Answers of the two for lengths {a['lengths']}: max |diff| {a['max_abs_diff']:.2e}"
        f" ({'within' if a['equal'] else 'NOT within'} {a['tolerance']:g})",
        "",
        "| model | req/s | p50 ms | p99 ms | mean batch |",
        "|---|---|---|---|---|",
    ]
    for name, x in (("without buckets", plain), (f"buckets + {graphs}", buckets)):
        lines.append(f"| {name} | {x['throughput']} | {x['p50_ms']} | {x['p99_ms']} | {x['mean_batch']} |")
    lines += ["", f"Throughput with buckets / without: {gain:.2f}x.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
