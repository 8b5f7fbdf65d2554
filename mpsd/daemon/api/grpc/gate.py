"""Every gRPC service of the daemon behind one synchronous method lookup: access control, then total
decoding.

grpc.aio runs each server interceptor as a coroutine on every call, before the method's own; on the 2-core
machine two of them (access, decoding) cost about 90 us of a small request's 0.7 ms. A generic handler is
asked for the method synchronously, so the same checks run here instead: the access policy per call (it
needs the call's metadata), the decoding guard once per method.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import grpc
import structlog

from mpsd.daemon.api.grpc.decode_guard import guard
from mpsd.net.auth import AccessPolicy, refusal

log = structlog.get_logger("mpsd.daemon.grpc")


class Services:
    """Stands in for the server while the services register (the generated `add_*_to_server` and
    reflection): it keeps their generic handlers for the gate."""

    def __init__(self) -> None:
        self.handlers: list[grpc.GenericRpcHandler] = []

    def add_generic_rpc_handlers(self, handlers: Iterable[grpc.GenericRpcHandler]) -> None:
        self.handlers.extend(handlers)

    def add_registered_method_handlers(self, service: str, handlers: object) -> None:
        """The same methods as the generic handlers registered with them: nothing more to keep."""


class Gate(grpc.GenericRpcHandler):  # type: ignore[misc]
    """`policy` may be replaced (SIGHUP re-reads tokens); the next call is checked against the new one."""

    def __init__(self, policy: AccessPolicy, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self.policy = policy
        self._handlers = tuple(handlers)
        self._guarded: dict[str, grpc.RpcMethodHandler] = {}  # only methods that exist: a bounded set

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method: str = handler_call_details.method
        error = self.policy.check(method, handler_call_details.invocation_metadata)
        if error is not None:
            log.info("call refused", method=method, code=error.code.value, reason=error.message)
            return refusal(error)
        handler = self._guarded.get(method)
        if handler is None:
            for generic in self._handlers:
                found = generic.service(handler_call_details)
                if found is not None:
                    handler = self._guarded[method] = guard(found)
                    break
        return handler
