"""A gRPC server with every service the daemon has. The daemon may run two: one on its public address and
one on the private socket its fronts relay to, which must not share the public port's options (a
connection age there would cut the fronts' relayed streams)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from mpsd.daemon.api.admin import SERVICE_NAME as ADMIN_SERVICE
from mpsd.daemon.api.admin import AdminServicer
from mpsd.daemon.api.health import HealthService
from mpsd.daemon.api.inference import InferenceServicer
from mpsd.daemon.api.inference import add_to_server as add_inference_service
from mpsd.proto import admin_pb2_grpc
from mpsd.proto import grpc_service_pb2 as pb


def grpc_server(
    servicer: InferenceServicer,
    health: HealthService,
    admin: AdminServicer,
    interceptors: Sequence[grpc.aio.ServerInterceptor],
    options: Sequence[tuple[str, Any]],
) -> grpc.aio.Server:
    """The server, its services added, no port bound yet."""
    server = grpc.aio.server(interceptors=list(interceptors), options=list(options))
    add_inference_service(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    admin_pb2_grpc.add_MpsdAdminServicer_to_server(admin, server)  # type: ignore[no-untyped-call]
    reflection.enable_server_reflection(
        (
            pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            ADMIN_SERVICE,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    return server
