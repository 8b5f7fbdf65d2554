"""The gRPC methods mpsd serves, with their call shapes: a front relays each one in its own shape."""

from __future__ import annotations


def served_methods() -> dict[str, tuple[bool, bool]]:
    """Every method the daemon serves: full name -> (client streaming, server streaming)."""
    from grpc_health.v1 import health_pb2
    from grpc_reflection.v1alpha import reflection_pb2

    from mpsd.proto import admin_pb2, grpc_service_pb2

    shapes = {}
    for module in (grpc_service_pb2, admin_pb2, health_pb2, reflection_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            for m in service.methods:
                shapes[f"/{service.full_name}/{m.name}"] = (m.client_streaming, m.server_streaming)
    return shapes
