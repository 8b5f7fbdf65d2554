"""Requests whose bytes are not a valid protobuf message get INVALID_ARGUMENT, not UNKNOWN.

gRPC decodes a request before the servicer sees it and answers a decoding failure (corrupt wire format,
a string field that is not UTF-8) with UNKNOWN plus a logged traceback. `guard` makes a method's decoding
total: a failure becomes a marker that the wrapped method turns into a clean INVALID_ARGUMENT (the daemon's
`Gate` guards every method it serves).
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

import grpc

from mpsd.errors import InvalidArgument
from mpsd.net.status import grpc_status

Behavior = Callable[..., Any]


class _Undecodable:
    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _total(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def decode(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:
            return _Undecodable(str(exc) or type(exc).__name__)

    return decode


async def _refuse(context: grpc.aio.ServicerContext, marker: _Undecodable) -> None:
    error = InvalidArgument(f"the request is not a valid protobuf message: {marker.reason}")
    await context.abort(grpc_status(error), error.message)


async def _checked(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, _Undecodable):
            await _refuse(context, request)
        yield request


def _guard_unary_request(behavior: Behavior) -> Behavior | None:
    if inspect.isasyncgenfunction(behavior):

        async def generator(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if isinstance(request, _Undecodable):
                await _refuse(context, request)
            async with aclosing(behavior(request, context)) as responses:
                async for response in responses:
                    yield response

        return generator
    if inspect.iscoroutinefunction(behavior):

        async def coroutine(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Undecodable):
                await _refuse(context, request)
            return await behavior(request, context)

        return coroutine
    return None


def _guard_stream_request(behavior: Behavior) -> Behavior | None:
    if inspect.isasyncgenfunction(behavior):

        async def generator(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
            async with aclosing(behavior(_checked(requests, context), context)) as responses:
                async for response in responses:
                    yield response

        return generator
    if inspect.iscoroutinefunction(behavior):

        async def coroutine(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
            return await behavior(_checked(requests, context), context)

        return coroutine
    return None


def guard(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """The same handler with total decoding; synchronous behaviours are left as they are."""
    if handler.request_deserializer is None:
        return handler
    decode = _total(handler.request_deserializer)
    encode = handler.response_serializer
    if not handler.request_streaming:
        if handler.response_streaming:
            wrapped = _guard_unary_request(handler.unary_stream)
            make = grpc.unary_stream_rpc_method_handler
        else:
            wrapped = _guard_unary_request(handler.unary_unary)
            make = grpc.unary_unary_rpc_method_handler
    elif handler.response_streaming:
        wrapped = _guard_stream_request(handler.stream_stream)
        make = grpc.stream_stream_rpc_method_handler
    else:
        wrapped = _guard_stream_request(handler.stream_unary)
        make = grpc.stream_unary_rpc_method_handler
    if wrapped is None:
        return handler
    result: grpc.RpcMethodHandler = make(wrapped, request_deserializer=decode, response_serializer=encode)
    return result
