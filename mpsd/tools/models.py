"""`mpsd models`: the short answer to "what does the daemon serve?" (`mpsd status` adds the workers)."""

from __future__ import annotations

import argparse
import json

import grpc

from mpsd.tools.client import connect, inference_stub, rpc_failure
from mpsd.tools.common import table


def run(conn: argparse.Namespace, ready_only: bool, json_output: bool, timeout: float) -> int:
    """One row per model version from RepositoryIndex: name, version, state and why it is not ready."""
    from mpsd.proto import grpc_service_pb2 as pb

    with connect(conn) as channel:
        stub = inference_stub(channel, conn.address, timeout)
        try:
            index = stub.RepositoryIndex(pb.RepositoryIndexRequest(ready=ready_only), timeout=timeout)
        except grpc.RpcError as exc:
            raise rpc_failure(exc) from None
    rows = [
        {"name": m.name, "version": m.version, "state": m.state, "reason": m.reason} for m in index.models
    ]
    if json_output:
        print(json.dumps(rows, indent=2))
    elif not rows:
        print("no models" + (" ready" if ready_only else ""))
    else:
        cells = [[r["name"], r["version"] or "-", r["state"], r["reason"]] for r in rows]
        print(table(["MODEL", "VERSION", "STATE", "REASON"], cells))
    return 0
