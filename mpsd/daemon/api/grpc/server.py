"""A gRPC server with every service the daemon has. The daemon may run two: one on its public address and
one on the private socket its fronts relay to, which must not share the public port's options (a
connection age there would cut the fronts' relayed streams)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from mpsd.daemon.api.grpc.admin import SERVICE_NAME as ADMIN_SERVICE
from mpsd.daemon.api.grpc.admin import AdminServicer
from mpsd.daemon.api.grpc.gate import Gate, Services
from mpsd.daemon.api.grpc.health import HealthService
from mpsd.daemon.api.grpc.inference import InferenceServicer
from mpsd.proto import admin_pb2_grpc
from mpsd.proto import grpc_service_pb2 as pb


def services(servicer: InferenceServicer, health: HealthService, admin: AdminServicer) -> Services:
    """Every service the daemon serves over gRPC, as generic handlers for a `Gate`."""
    found = Services()
    add_inference_service(servicer, found)
    health_pb2_grpc.add_HealthServicer_to_server(health, found)
    admin_pb2_grpc.add_MpsdAdminServicer_to_server(admin, found)  # type: ignore[no-untyped-call]
    reflection.enable_server_reflection(
        (
            pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            ADMIN_SERVICE,
            reflection.SERVICE_NAME,
        ),
        found,
    )
    return found


def grpc_server(gate: Gate, options: Sequence[tuple[str, Any]]) -> grpc.aio.Server:
    """A server whose every call goes through `gate` (shared by the daemon's servers), no port bound yet: its
    shortcut first, for the inference methods open to every caller."""
    server = grpc.aio.server(options=list(options))
    server.add_generic_rpc_handlers((gate.shortcut, gate))
    return server


RAW_METHODS = frozenset({"ModelInfer"})


def add_inference_service(servicer: InferenceServicer, server: grpc.aio.Server) -> None:
    """Register the service from its descriptor, like the generated `add_..._to_server`, except that the
    methods in RAW_METHODS get the request's bytes and return the response's bytes: ModelInfer cuts the
    tensor bytes out of the wire form itself (`ipc/infer_wire.py`) instead of letting protobuf copy them."""
    service = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    handlers = {}
    for method in service.methods:
        behavior = getattr(servicer, method.name)
        if method.name in RAW_METHODS:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(behavior)
            continue
        codec = {
            "request_deserializer": getattr(pb, method.input_type.name).FromString,
            "response_serializer": getattr(pb, method.output_type.name).SerializeToString,
        }
        if method.client_streaming and method.server_streaming:
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(behavior, **codec)
        elif method.client_streaming:
            handlers[method.name] = grpc.stream_unary_rpc_method_handler(behavior, **codec)
        elif method.server_streaming:
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(behavior, **codec)
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(behavior, **codec)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
