"""Wait until the daemon answers the standard gRPC health check.

launchd has no readiness protocol, and a started process is not a serving one (models may still be
loading), so `install`/`start` poll `grpc.health.v1.Health/Check` with service "" instead.
"""

from __future__ import annotations

import argparse
import time
from typing import TextIO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mpsd.connect import open_channel


class HealthTimeout(Exception):
    """The daemon did not report SERVING in time; `last` says what the last attempt saw."""

    def __init__(self, last: str) -> None:
        super().__init__(last)
        self.last = last


def check_once(address: str, timeout_s: float, credentials: argparse.Namespace | None = None) -> str:
    """One Health/Check call; returns "SERVING", another status name, or the gRPC error code.

    `credentials` carries the tools' TLS and token options (`mpsd.cli.connection.add_credential_args`): a
    daemon with TLS or tokens answers the probe only with them.
    """
    options = vars(credentials) if credentials is not None else {}
    channel = open_channel(argparse.Namespace(**{**options, "address": address}))
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        response = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        status: int = response.status
        name: str = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
        return name
    except grpc.RpcError as exc:
        code = exc.code()
        return str(code.name) if code is not None else "RPC error"
    finally:
        channel.close()


def wait_until_serving(
    address: str,
    timeout_s: float,
    *,
    progress: TextIO,
    interval_s: float = 0.5,
    credentials: argparse.Namespace | None = None,
) -> float:
    """Poll until SERVING; prints a dot per attempt on `progress`. Returns seconds waited."""
    start = time.monotonic()
    deadline = start + timeout_s
    print(f"waiting for mpsd to report SERVING on {address} (up to {timeout_s:g} s) ", end="", file=progress)
    progress.flush()
    last = "no attempt"
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            print(" gave up", file=progress, flush=True)
            raise HealthTimeout(last)
        last = check_once(address, min(1.0, remaining), credentials)
        if last == "SERVING":
            elapsed = time.monotonic() - start
            print(f" ready after {elapsed:.1f} s", file=progress, flush=True)
            return elapsed
        print(".", end="", file=progress, flush=True)
        time.sleep(min(interval_s, max(0.0, deadline - time.monotonic())))
