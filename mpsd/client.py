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

The same spreads calls over one daemon's front processes where each listens on a port of its own
(`front_ports`, for macOS, whose kernel does not spread one shared port's connections); see
docs/performance.md:

    from mpsd.client import balanced_channel_args, front_target

    target = front_target("127.0.0.1:8001")  # the ports the daemon lists, on the host it is reached at
    client = grpcclient.InferenceServerClient(target, channel_args=balanced_channel_args())
"""

from __future__ import annotations

import ipaddress
import json
import socket
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import grpc

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


def front_target(
    address: str,
    ports: Sequence[int] | None = None,
    *,
    credentials: grpc.ChannelCredentials | None = None,
    metadata: Sequence[tuple[str, str]] = (),
    timeout: float = 10.0,
) -> str:
    """The target naming one daemon's fronts of `front_ports`, for `balanced_channel_args`: `ports` (by
    default the ones the daemon lists, `front_ports`) on the host of `address`, the daemon's gRPC address
    as this client reaches it. A host name is resolved here, once (an IPv4 address first)."""
    host = address.rpartition(":")[0].strip("[]")
    if not host:
        raise ValueError(f"{address!r}: expected host:port")
    if ports is None:
        ports = front_ports(address, credentials=credentials, metadata=metadata, timeout=timeout)
    if not ports:
        raise ValueError(f"{address}: the daemon runs no fronts on ports of their own (front_ports)")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        host = str(sorted(found, key=lambda info: info[0] != socket.AF_INET)[0][4][0])
    name = f"[{host}]" if ":" in host else host
    return balanced_target([f"{name}:{port}" for port in ports])


def front_ports(
    address: str,
    *,
    credentials: grpc.ChannelCredentials | None = None,
    metadata: Sequence[tuple[str, str]] = (),
    timeout: float = 10.0,
) -> list[int]:
    """The ports of the daemon's fronts that listen alone, in front order, as its admin service lists them
    (ListWorkers; with tokens, one of the logs-statistics category in `metadata`)."""
    import grpc

    from mpsd.proto import admin_pb2, admin_pb2_grpc

    if credentials is not None:
        channel = grpc.secure_channel(address, credentials)
    else:
        channel = grpc.insecure_channel(address)
    with channel:
        stub = admin_pb2_grpc.MpsdAdminStub(channel)  # type: ignore[no-untyped-call]
        reply = stub.ListWorkers(admin_pb2.ListWorkersRequest(), metadata=list(metadata), timeout=timeout)
    return [int(front.port) for front in sorted(reply.fronts, key=lambda f: f.index) if front.port]
