"""The Speculate stream on a Unix socket: the same-host carrier for draft steps.

A verify service whose draft runs on the same host carries the per-step
SpeculateRequest / Proposal messages over a Unix socket instead of the gRPC
stream: no gRPC thread wakes up on the hop. The messages and their meaning do not
change (protobuf bytes, the same step-id rules, the same errors); only the carrier
does. Drafts serve the socket by default (``--local-socket auto``) and a verify
service that reaches it uses it (``--draft-socket auto``).

Frames: a 5-byte header, ``<I`` payload length and one kind byte, then the payload.

    HELLO    server -> client, first: the draft's instance id (utf-8), so a client
             knows the socket it reached belongs to the draft it asked GetInfo of;
             then, for a draft that reads hidden states, a newline and the path of
             the connection's shared buffer (common/wire/shared_buffer.py)
    MESSAGE  a serialized protobuf (SpeculateRequest one way, Proposal the other)
    ERROR    server -> client, last: "CODE\\nmessage" (a gRPC status code name), then
             the server closes the connection, as a gRPC stream ends with a status

An address is a filesystem path, or ``@name`` for Linux's abstract namespace (no
file; reachable from every process in the same network namespace).
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import struct
import sys
from collections.abc import AsyncIterator
from typing import Generic, Protocol, TypeVar

HELLO, MESSAGE, ERROR = 1, 2, 3
KINDS = (HELLO, MESSAGE, ERROR)
_HEADER = struct.Struct("<IB")
MAX_FRAME_BYTES = 64 * 1024 * 1024      # as treespec.common.serving.grpc_server.MAX_MESSAGE_BYTES


class FrameError(Exception):
    """The peer broke the framing (unknown kind, oversized frame, bad hello)."""


class StreamFailed(RuntimeError):
    """The server ended the stream with an error frame."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def new_instance_id() -> str:
    return secrets.token_hex(8)


def auto_address(instance_id: str) -> str | None:
    """The default address: an abstract socket named after the instance (Linux only)."""
    return f"@treespec-draft-{instance_id}" if sys.platform.startswith("linux") else None


def os_address(address: str) -> str:
    """The path the socket API takes (``@name`` -> a leading NUL byte)."""
    return "\0" + address[1:] if address.startswith("@") else address


def listen_unix(address: str) -> socket.socket:
    """A listening socket at address for ``asyncio.start_unix_server(sock=...)``. Made
    here, not by the event loop: uvloop refuses abstract (``@name``) addresses with
    EINVAL, and the services run on uvloop, so they fell back to gRPC unnoticed."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(os_address(address))
        s.listen(64)
        s.setblocking(False)
    except BaseException:
        s.close()
        raise
    return s


async def connect_unix(address: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A stream connected to address (see listen_unix for why not the loop's own)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(s, os_address(address))
    except BaseException:
        s.close()
        raise
    return await asyncio.open_unix_connection(sock=s)


def pack(kind: int, payload: bytes = b"") -> list[bytes]:
    """One frame as buffers for ``writer.writelines`` (the payload is not copied)."""
    if len(payload) > MAX_FRAME_BYTES:
        raise FrameError(f"a frame of {len(payload)} bytes exceeds {MAX_FRAME_BYTES}")
    return [_HEADER.pack(len(payload), kind), payload]


async def read_frame(reader: asyncio.StreamReader) -> tuple[int, bytes] | None:
    """The next (kind, payload), or None at a clean end of stream."""
    try:
        n, kind = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    except asyncio.IncompleteReadError as e:
        if e.partial:
            raise FrameError("the stream ended inside a frame header") from e
        return None
    if kind not in KINDS:
        raise FrameError(f"unknown frame kind {kind}")
    if n > MAX_FRAME_BYTES:
        raise FrameError(f"a frame of {n} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        return kind, await reader.readexactly(n)
    except asyncio.IncompleteReadError as e:
        raise FrameError(f"the stream ended {n - len(e.partial)} bytes short of a "
                         "frame") from e


def error_payload(code: str, message: str) -> bytes:
    return f"{code}\n{message}".encode()


class _Message(Protocol):
    def SerializeToString(self) -> bytes: ...


M = TypeVar("M")


class FrameStream(Generic[M]):
    """The client end of a framed stream, shaped as a gRPC stream-stream call:
    ``await write(msg)``, ``async for reply in stream``, ``cancel()``.

    Replies are parsed with ``parse`` (e.g. ``pb.Proposal.FromString``); an ERROR
    frame raises StreamFailed, a broken frame FrameError."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 parse) -> None:
        self._reader = reader
        self._writer = writer
        self._parse = parse
        self.shared_path: str | None = None     # the draft's shared buffer, if it named one

    @classmethod
    async def open(cls, address: str, instance_id: str, parse,
                   timeout_s: float = 2.0) -> FrameStream:
        """Connect and check the server's hello against instance_id (FrameError if not)."""
        reader, writer = await asyncio.wait_for(connect_unix(address), timeout_s)
        stream = cls(reader, writer, parse)
        try:
            hello = await asyncio.wait_for(read_frame(reader), timeout_s)
            if hello is None or hello[0] != HELLO:
                raise FrameError(f"{address} did not greet with a hello frame")
            who, _, shared = hello[1].decode(errors="replace").partition("\n")
            if who != instance_id:
                raise FrameError(f"{address} belongs to another draft instance")
            stream.shared_path = shared or None
        except BaseException:
            stream.cancel()
            raise
        return stream

    async def write(self, msg: _Message) -> None:
        self._writer.writelines(pack(MESSAGE, msg.SerializeToString()))
        await self._writer.drain()

    async def __aiter__(self) -> AsyncIterator[M]:
        while (frame := await read_frame(self._reader)) is not None:
            kind, payload = frame
            if kind == MESSAGE:
                yield self._parse(payload)
            elif kind == ERROR:
                code, _, message = payload.decode(errors="replace").partition("\n")
                raise StreamFailed(code, message)
            else:
                raise FrameError(f"unexpected frame kind {kind} after the hello")

    def cancel(self) -> None:
        self._writer.close()
