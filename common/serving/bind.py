"""Exclusive ports: a port another socket holds is refused, in one line naming its flag.

gRPC shares a port by default (SO_REUSEPORT): a second server on a port in use
would start and take a share of the first one's new connections. Every server we
start passes ``GRPC_OPTIONS``, which turns that off, and binds through ``add_port``,
which turns either way grpcio reports a failed bind (a return of 0, or, in grpcio
>= 1.85, a RuntimeError) into a ``BindError``. ``check_bindable`` binds a port as
those servers will (SO_REUSEADDR, no SO_REUSEPORT) and lets it go: run before a
service loads its model, it refuses a port in use or an address that is not this
machine's in a second rather than after the load.

    BindError("--port 50051: address already in use")
    BindError("--host 10.9.9.9: not an address of this machine")
"""

from __future__ import annotations

import errno
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import grpc

GRPC_OPTIONS = [("grpc.so_reuseport", 0)]


class BindError(OSError):
    """A listener could not be bound; the message names the flag and why."""


def _why(e: OSError, host: str, port: int, flag: str) -> BindError:
    if isinstance(e, socket.gaierror):
        return BindError(f"--host {host}: cannot resolve it ({e.strerror})")
    if e.errno == errno.EADDRNOTAVAIL:
        return BindError(f"--host {host}: not an address of this machine")
    if e.errno == errno.EADDRINUSE:
        return BindError(f"{flag} {port}: address already in use")
    if e.errno == errno.EACCES:
        return BindError(f"{flag} {port}: permission denied (ports below 1024 need privileges)")
    return BindError(f"{flag} {port}: cannot bind {host}:{port} ({e.strerror or e})")


def check_bindable(host: str, port: int, flag: str = "--port") -> None:
    """BindError unless host:port can be bound now (port 0: unless host can be).

    A name that resolves to several addresses (localhost) passes when one of them
    binds, as a gRPC server then starts on that one.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except OSError as e:
        raise _why(e, host, port, flag) from None
    first: OSError | None = None
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(addr)
            except OSError as e:
                first = first or e
                continue
        return
    if first is not None:
        raise _why(first, host, port, flag)


def bind_address(host: str, port: int) -> str:
    """host:port as gRPC wants it ([v6]:port for an IPv6 literal)."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


def add_port(server: grpc.aio.Server, host: str, port: int,
             credentials: grpc.ServerCredentials | None, flag: str = "--port") -> int:
    """Bind server to host:port (TLS when credentials are given); the bound port."""
    addr = bind_address(host, port)
    try:
        bound = (server.add_secure_port(addr, credentials) if credentials is not None
                 else server.add_insecure_port(addr))
    except RuntimeError:
        bound = 0
    if bound == 0:
        check_bindable(host, port, flag)        # names the reason where a socket sees it
        raise BindError(f"{flag} {port}: cannot bind {addr}")
    return bound
