"""The grpc.aio server both services run: error mapping, health, reflection, stop.

Servicers stay thin: they raise ``treespec.common.serving.errors`` types (or let a
``codec.CodecError`` through) and the interceptor here turns them into status
codes, so no servicer method carries its own try/except:

    InvalidRequest, CodecError -> INVALID_ARGUMENT   (the message says what was wrong)
    Unavailable                -> UNAVAILABLE
    anything else              -> INTERNAL           (logged with its traceback)

``start_server`` builds and starts a server; ``run_server`` is the process
main: uvloop, a ``listening on HOST:PORT`` first line on stdout, then graceful
shutdown on SIGINT/SIGTERM (health NOT_SERVING, ``on_stop``,
``await server.stop(grace)``), as grpc's
``async_greeter_server_with_graceful_shutdown.py``.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import logging
import signal
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from treespec.common.wire import codec
from treespec.common.serving.auth import HANDLER_FACTORIES, AuthInterceptor
from treespec.common.serving.bind import GRPC_OPTIONS, add_port
from treespec.common.serving.errors import InvalidRequest, Overloaded, Unavailable
from treespec.common.serving.tls import ServerTLS

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024      # servers and the draft link's channel
MESSAGE_LIMITS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                  ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
# Calls the server has accepted but not yet handed to a handler. Past 1000 of them gRPC
# core drops calls at random as bare CANCELLED, which no handler sees or counts (2000
# simultaneous calls lost ~200); this lets our admission control (RESOURCE_EXHAUSTED)
# answer every call, and past it gRPC refuses with RESOURCE_EXHAUSTED, never at random.
MAX_PENDING_CALLS = 1 << 16

_health_of: weakref.WeakKeyDictionary[grpc.aio.Server, health.aio.HealthServicer] = \
    weakref.WeakKeyDictionary()


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and details an exception leaves a handler with."""
    if isinstance(exc, (InvalidRequest, codec.CodecError)):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, Unavailable):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, Overloaded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


async def _abort(context: grpc.aio.ServicerContext, method: str, exc: Exception) -> None:
    code, details = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("unhandled error in %s", method)
    await context.abort(code, details)


def _parser(deserialize: Callable | None, method: str) -> Callable:
    """bytes -> request; a message that does not decode is the client's error."""
    def parse(raw: Any) -> Any:
        if deserialize is None:
            return raw
        try:
            return deserialize(raw)
        except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and kin
            raise InvalidRequest(f"undecodable {method.rsplit('/', 1)[-1]} request: "
                                 f"{type(e).__name__}: {e}") from None
    return parse


def _wrap(behavior: Callable, method: str, parse: Callable, streaming: bool) -> Callable:
    """The same async handler behaviour, taking raw bytes (parsed here, so that an
    undecodable message is INVALID_ARGUMENT, not a traceback), with exceptions mapped
    to status codes."""
    async def requests(raw_iter: AsyncIterator) -> AsyncIterator:
        async for raw in raw_iter:
            yield parse(raw)

    def inputs(raw: Any) -> Any:
        return requests(raw) if streaming else parse(raw)

    if inspect.isasyncgenfunction(behavior):
        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator:
            try:
                async for response in behavior(inputs(request), context):
                    yield response
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001 - mapped to a status, never swallowed
                await _abort(context, method, exc)
        return stream

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await behavior(inputs(request), context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001
            await _abort(context, method, exc)
    return unary


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every handler so that domain errors become gRPC status codes."""

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails
                                ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None:
            return None
        kind = (handler.request_streaming, handler.response_streaming)
        behavior = {(False, False): handler.unary_unary, (False, True): handler.unary_stream,
                    (True, False): handler.stream_unary, (True, True): handler.stream_stream}[kind]
        if not (inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)):
            return handler      # a sync handler runs in grpc's thread pool, as it is
        parse = _parser(handler.request_deserializer, details.method)
        return HANDLER_FACTORIES[kind](_wrap(behavior, details.method, parse, kind[0]),
                                     request_deserializer=None,
                                     response_serializer=handler.response_serializer)


async def start_server(host: str, port: int, add_servicers: Callable[[grpc.aio.Server], None],
                       service_names: list[str],
                       interceptors: list[grpc.aio.ServerInterceptor] | None = None,
                       tls: ServerTLS | None = None, api_keys: tuple[bytes, ...] | None = None,
                       reflect: bool = True, max_receive: int = MAX_MESSAGE_BYTES
                       ) -> tuple[grpc.aio.Server, int]:
    """A started grpc.aio server with error mapping, health and reflection.

    add_servicers registers the service's own servicers; service_names are their
    full names (e.g. "treespec.v1.Drafter"), each reported SERVING by health and
    listed by reflection. port 0 binds a free port; returns (server, bound port).
    interceptors (e.g. tracing) run outside the error mapping, first one outermost.
    tls on: the port serves TLS only (mutual TLS when it names a client CA); api_keys:
    every call but health checks needs one of them (treespec.common.serving.auth); reflect: serve
    gRPC reflection; max_receive: a larger request is refused unread
    (RESOURCE_EXHAUSTED). The port is not shared: one another socket holds raises
    treespec.common.serving.bind.BindError.
    """
    auth = [AuthInterceptor(api_keys)] if api_keys else []
    server = grpc.aio.server(
        interceptors=[*auth, *(interceptors or ()), ErrorMappingInterceptor()],
        options=[MESSAGE_LIMITS[0], ("grpc.max_receive_message_length", max_receive),
                 ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
                 ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
                 *GRPC_OPTIONS])
    add_servicers(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
    if reflect:
        reflection.enable_server_reflection(
            [*service_names, health_name, reflection.SERVICE_NAME], server)
    bound = add_port(server, host, port, tls.credentials() if tls is not None else None)
    for name in ("", *service_names):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    _health_of[server] = health_servicer
    await server.start()
    return server, bound


async def _serve(start: Callable[[], Awaitable[tuple[grpc.aio.Server, int]]], host: str,
                 on_stop: Callable[[], Awaitable[None]] | None, grace_s: float) -> None:
    server, port = await start()
    # what start() built (the model, imported libraries: ~10^5 objects) lives as long as
    # the process: out of the collector's sight, so that a full collection during
    # serving walks only what requests allocated (78 ms -> 0 ms on a CPU VM)
    gc.freeze()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    # only now: a supervisor that signals as soon as it reads this line is handled
    print(f"listening on {host}:{port}", flush=True)
    try:
        await stop.wait()
        log.info("stopping: NOT_SERVING, then %.1fs grace", grace_s)
        health_servicer = _health_of.get(server)
        if health_servicer is not None:
            await health_servicer.enter_graceful_shutdown()
        if on_stop is not None:
            await on_stop()
    finally:
        await server.stop(grace_s)


def run_server(start: Callable[[], Awaitable[tuple[grpc.aio.Server, int]]], host: str,
               on_stop: Callable[[], Awaitable[None]] | None = None,
               grace_s: float = 5.0) -> None:
    """Serve until SIGINT/SIGTERM; the first stdout line is ``listening on HOST:PORT``."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(_serve(start, host, on_stop, grace_s))
    else:
        uvloop.run(_serve(start, host, on_stop, grace_s))
