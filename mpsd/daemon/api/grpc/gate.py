"""Every gRPC service of the daemon behind one synchronous method lookup: access control, then total
decoding.

grpc.aio runs each server interceptor as a coroutine on every call, before the method's own; on the 2-core
machine two of them (access, decoding) cost about 90 us of a small request's 0.7 ms. A generic handler is
asked for the method synchronously, so the same checks run here instead: the access policy per call (it
needs the call's metadata), the decoding guard once per method.

An inference method that the policy lets anybody call (any method no token is needed for: every one that
is not operator-only, while no tokens are configured) needs no check per call: the `Shortcut`, registered
before the gate, answers it from a table grpc looks up itself, so such a call enters no code of the gate's.
The table is made again whenever the policy is replaced.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import grpc
import structlog

from mpsd.daemon.api.grpc.decode_guard import guard
from mpsd.net.auth import METHOD_CATEGORY, AccessPolicy, refusal

log = structlog.get_logger("mpsd.daemon.grpc")
INFERENCE = "inference.GRPCInferenceService"
# The inference service's methods (every one has a category of its own).
INFERENCE_METHODS = tuple(m for m in METHOD_CATEGORY if m.startswith(f"/{INFERENCE}/"))
Lookup = Callable[[grpc.HandlerCallDetails], "grpc.RpcMethodHandler | None"]


class _Method(NamedTuple):
    """A method's call details, as a generic handler reads them when it is asked for the method by name."""

    method: str
    invocation_metadata: tuple[tuple[str, str], ...] = ()


def _nothing(handler_call_details: grpc.HandlerCallDetails) -> None:
    return None


class Shortcut:
    """The inference methods open to every caller, straight to their handlers (`service`: grpc's own lookup
    of a table of them; with none open, a lookup that finds nothing and leaves the call to the gate)."""

    def __init__(self) -> None:
        self.service: Lookup = _nothing

    def open(self, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        """`handlers`: the open methods' handlers by short name (`ModelInfer`)."""
        table = grpc.method_handlers_generic_handler(INFERENCE, handlers)
        self.service = table.service if handlers else _nothing


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
        self._handlers = tuple(handlers)
        self._guarded: dict[str, grpc.RpcMethodHandler] = {}  # only methods that exist: a bounded set
        self.shortcut = Shortcut()  # registered before the gate
        self.policy = policy

    @property
    def policy(self) -> AccessPolicy:
        return self._policy

    @policy.setter
    def policy(self, policy: AccessPolicy) -> None:
        self._policy = policy
        self.shortcut.open(self._open_methods(policy))

    def _open_methods(self, policy: AccessPolicy) -> dict[str, grpc.RpcMethodHandler]:
        """The inference methods `policy` lets a call without metadata make: then it lets every call make
        them (a token is not even looked at), so they need no check per call."""
        table = {}
        for method in INFERENCE_METHODS:
            if policy.check(method, None) is None:
                handler = self._handler(_Method(method))
                if handler is not None:
                    table[method.rsplit("/", 1)[1]] = handler
        return table

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method: str = handler_call_details.method
        error = self.policy.check(method, handler_call_details.invocation_metadata)
        if error is not None:
            log.info("call refused", method=method, code=error.code.value, reason=error.message)
            return refusal(error)
        return self._handler(handler_call_details)

    def _handler(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        """The method's handler, with its decoding guarded (None: no such method)."""
        method: str = handler_call_details.method
        handler = self._guarded.get(method)
        if handler is None:
            for generic in self._handlers:
                found = generic.service(handler_call_details)
                if found is not None:
                    handler = self._guarded[method] = guard(found)
                    break
        return handler
