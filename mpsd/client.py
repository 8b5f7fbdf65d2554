"""Client-side balancing over several daemons with gRPC's own mechanisms, for any gRPC client in Python
(the stock `tritonclient.grpc` takes them as `channel_args`):

    import tritonclient.grpc as grpcclient
    from mpsd.client import balanced_channel_args, balanced_target

    hosts = ["10.0.0.1:8001", "10.0.0.2:8001"]
    client = grpcclient.InferenceServerClient(
        balanced_target(hosts), channel_args=balanced_channel_args(service="resnet")
    )

One channel holds a connection to every host and spreads calls over them (`round_robin`); it watches each
host's `grpc.health.v1.Health` for `service` (gRFC A17: the daemon's health service; "" is the daemon,
a model's name that model) and sends nothing to a host that is not `SERVING`, as at the start of a
daemon's shutdown; a call that fails with UNAVAILABLE before the host answered (the host died, its
connection closed) is retried on another host (gRFC A6). See docs/scale-out.md.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Sequence
from typing import Any

SERVICE = "inference.GRPCInferenceService"
# tritonclient's own default (its MAX_GRPC_MESSAGE_SIZE): channel_args replace its defaults
MAX_MESSAGE_BYTES = 2**31 - 1
# the RPCs that change nothing on the daemon, so that a second attempt is harmless
RETRIED = ("ModelInfer", "ModelReady", "ModelMetadata", "ModelConfig", "ServerReady", "ServerMetadata")


def balanced_target(hosts: Sequence[str]) -> str:
    """The gRPC target naming every one of `hosts` (`host:port`): `ipv4:a:p,b:p` or `ipv6:[a]:p,...` for
    addresses; one DNS name (`dns:///name:port`), whose every address is a host, for a name."""
    if not hosts:
        raise ValueError("no hosts")
    families: set[int] = set()  # 4, 6, or 0 for a name
    for host in hosts:
        name, sep, port = host.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"{host!r}: expected host:port")
        try:
            families.add(ipaddress.ip_address(name.strip("[]")).version)
        except ValueError:
            families.add(0)
    if families == {4}:
        return "ipv4:" + ",".join(hosts)
    if families == {6}:
        return "ipv6:" + ",".join(hosts)
    if families == {0} and len(hosts) == 1:
        return f"dns:///{hosts[0]}"
    raise ValueError(
        "one gRPC target lists addresses of one family, or one DNS name whose addresses are the hosts: "
        f"{list(hosts)}"
    )


def service_config(
    service: str = "", max_attempts: int = 5, methods: Sequence[str] = RETRIED
) -> dict[str, Any]:
    """The service config: round_robin, health checking of `service`, retries of UNAVAILABLE."""
    return {
        "loadBalancingConfig": [{"round_robin": {}}],
        "healthCheckConfig": {"serviceName": service},
        "methodConfig": [
            {
                "name": [{"service": SERVICE, "method": method} for method in methods],
                "retryPolicy": {
                    "maxAttempts": max_attempts,
                    "initialBackoff": "0.05s",
                    "maxBackoff": "1s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ],
    }


def balanced_channel_args(
    service: str = "",
    max_attempts: int = 5,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    methods: Sequence[str] = RETRIED,
) -> list[tuple[str, Any]]:
    """Channel options (`grpc.insecure_channel(target, options=...)`, tritonclient's `channel_args`) for
    the target of `balanced_target`: `service_config(service, ...)`, retries on, no DNS-provided service
    config in its place, and message size limits (tritonclient's defaults, which these replace)."""
    return [
        ("grpc.service_config", json.dumps(service_config(service, max_attempts, methods))),
        ("grpc.enable_retries", 1),
        ("grpc.service_config_disable_resolution", 1),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]
