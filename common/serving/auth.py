"""Bearer tokens: a server admits a call whose ``authorization: Bearer <token>``
metadata matches one of the tokens in its key file (compared in constant time);
anything else ends UNAUTHENTICATED before a handler runs. Health checks stay open
(orchestrators probe without a token).

A key file holds one token a line; blank lines and lines starting with # are skipped.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable
from pathlib import Path

import grpc

log = logging.getLogger(__name__)

OPEN_PREFIX = "/grpc.health.v1.Health/"


def read_keys(path: str, flag: str = "--api-key-file") -> tuple[bytes, ...]:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ValueError(f"{flag} {path!r}: {e.strerror or e}") from None
    keys = tuple(t.strip().encode() for t in lines if t.strip() and not t.startswith("#"))
    if not keys:
        raise ValueError(f"{flag} {path!r} holds no token")
    return keys


def metadata(key: str | None) -> tuple[tuple[str, str], ...] | None:
    """What a client sends with each call (None: nothing)."""
    return (("authorization", f"Bearer {key}"),) if key else None


def _admits(keys: tuple[bytes, ...], md) -> bool:
    given = next((v for k, v in (md or ()) if k == "authorization"), None)
    if isinstance(given, str):
        given = given.encode()
    if not given or not given.startswith(b"Bearer "):
        return False
    token = given[len(b"Bearer "):]
    ok = False
    for k in keys:                      # every key compared: the time says nothing
        ok |= hmac.compare_digest(token, k)
    return ok


# a handler of the same kind as another: by (request streaming, response streaming)
HANDLER_FACTORIES: dict[tuple[bool, bool], Callable] = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def _refuse(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                            "missing or unknown bearer token (metadata 'authorization: "
                            "Bearer <token>')")

    async def stream(request, context):
        await unary(request, context)
        yield  # pragma: no cover - abort raises

    make = HANDLER_FACTORIES[(handler.request_streaming, handler.response_streaming)]
    return make(stream if handler.response_streaming else unary,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, keys: tuple[bytes, ...]) -> None:
        self.keys = keys
        self._refused = 0

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_PREFIX):
            return handler
        if _admits(self.keys, details.invocation_metadata):
            return handler
        self._refused += 1
        if self._refused in (1, 10) or self._refused % 1000 == 0:
            log.warning("refused %s without a valid bearer token (%d so far)",
                        details.method, self._refused)
        return _refuse(handler)
