"""The Speculate stream on a Unix socket, for a verify service on the same host.

Same messages, same servicer (``DrafterServicer.answer``), same step-id rule and
the same errors as the gRPC stream (``treespec.common.serving.grpc_server.status_for``); only the
carrier differs (common/wire/frames.py says why). Each connection is one stream: a
hello frame with the draft's instance id (and, for a drafter that reads target
hidden states, the connection's shared buffer: common/wire/shared_buffer.py), then one
Proposal per SpeculateRequest, in order. A malformed message ends the connection
with an ERROR frame.

Only processes of this service's own user (or of the uids in ``allowed_uids``) may
connect: the kernel says who the peer is (SO_PEERCRED), and anyone else is closed
on before a byte is read, with one log line per refused uid. Where the kernel cannot
say (no SO_PEERCRED), no local socket is offered (``peer_check_possible``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
import time

import torch
from google.protobuf.message import DecodeError

from treespec.common.wire import frames
from treespec.common.serving.errors import InvalidRequest
from treespec.common.serving.grpc_server import status_for
from treespec.common.wire.shared_buffer import SharedBuffer
from treespec.draft_service.servicer import DrafterServicer, StepOrder
from treespec.protos.treespec.v1 import treespec_pb2 as pb

log = logging.getLogger("treespec.draft.local")


def peer_check_possible() -> bool:
    return hasattr(socket, "SO_PEERCRED")


def peer_uid(sock: socket.socket) -> int:
    """The connected peer's user id, from the kernel."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", raw)[1]


class LocalServer:
    def __init__(self, servicer: DrafterServicer, address: str,
                 allowed_uids: tuple[int, ...] = ()) -> None:
        self.servicer = servicer
        self.address = address
        self.allowed = {os.getuid(), *allowed_uids}
        self._refused: set[int] = set()
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[asyncio.Task] = set()

    def _remove_file(self) -> None:
        """Unlink the socket file of a path address (an abstract one has none)."""
        path = frames.os_address(self.address)
        if not path.startswith("\0") and os.path.exists(path):
            os.unlink(path)

    async def start(self) -> None:
        self._remove_file()          # a stale socket file from a process that died
        self._server = await asyncio.start_unix_server(self._serve,
                                                       sock=frames.listen_unix(self.address))

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._conns):
                task.cancel()
            await asyncio.gather(*self._conns, return_exceptions=True)
            await self._server.wait_closed()
            self._server = None
            self._remove_file()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        uid = peer_uid(writer.get_extra_info("socket"))
        if uid not in self.allowed:
            if uid not in self._refused:
                self._refused.add(uid)
                log.warning("refused a local-socket connection from uid %d (allowed: %s; "
                            "--local-socket-uids adds uids)", uid, sorted(self.allowed))
            writer.close()
            return
        task = asyncio.current_task()
        self._conns.add(task)
        conn = _Connection(self.servicer, writer, self._shared_buffer())
        try:
            hello = self.servicer.instance_id + (f"\n{conn.shared.path}" if conn.shared else "")
            writer.writelines(frames.pack(frames.HELLO, hello.encode()))
            await self._stream(reader, conn)
        except (ConnectionError, asyncio.CancelledError):
            pass                 # the verify service went away, or we are stopping
        finally:
            self._conns.discard(task)
            writer.close()
            if conn.shared is not None:
                conn.shared.unlink()
                conn.shared.close()

    def _shared_buffer(self) -> SharedBuffer | None:
        """A new connection's buffer for target hidden states (None: not needed, or no
        /dev/shm here: they travel in the messages)."""
        if not self.servicer.engine.info.target_hidden_layers:
            return None
        try:
            return SharedBuffer.create(pin=torch.cuda.is_available())
        except OSError as e:
            log.warning("no shared buffer for hidden states (%s): they travel in the "
                        "messages", e)
            return None

    async def _stream(self, reader: asyncio.StreamReader, conn: _Connection) -> None:
        while True:
            try:
                frame = await frames.read_frame(reader)
            except frames.FrameError as e:
                await conn.fail(InvalidRequest(f"broken frame: {e}"))
                return
            received = time.time_ns()
            if frame is None or conn.failed:
                return
            kind, payload = frame
            if kind != frames.MESSAGE:
                await conn.fail(InvalidRequest(f"expected a SpeculateRequest frame, "
                                               f"got kind {kind}"))
                return
            await conn.handle(payload, received)


class _Connection:
    """One verify service's stream: its step order and the answers it gets."""

    def __init__(self, servicer: DrafterServicer, writer: asyncio.StreamWriter,
                 shared: SharedBuffer | None) -> None:
        self.servicer = servicer
        self.writer = writer
        self.shared = shared
        self.order = StepOrder()
        self.failed = False

    async def handle(self, payload: bytes, received: int) -> None:
        try:
            try:
                msg = pb.SpeculateRequest.FromString(payload)
            except DecodeError as e:
                raise InvalidRequest(f"undecodable SpeculateRequest: {e}") from e
            self.order.check(msg.step_id)
            if self.shared is not None:
                self.shared.unlink()          # the verify service has mapped it by now
            reply, req = await self.servicer.answer(msg, received, self.shared)
        except (ConnectionError, asyncio.CancelledError):
            raise
        except Exception as e:  # noqa: BLE001 - mapped to an error frame, never swallowed
            await self.fail(e)
            return
        if self.writer.is_closing():      # the stream ended while this step ran
            return
        self.writer.writelines(frames.pack(frames.MESSAGE, reply.SerializeToString()))
        await self.writer.drain()
        try:
            ahead = await self.servicer.lookahead(req)
        except Exception as e:  # noqa: BLE001 - as a step's failure
            await self.fail(e)
            return
        if ahead is not None and not self.writer.is_closing():
            self.writer.writelines(frames.pack(frames.MESSAGE, ahead.SerializeToString()))
            await self.writer.drain()

    async def fail(self, e: Exception) -> None:
        """End the stream with an error frame, as a gRPC stream ends with a status."""
        self.failed = True
        code, details = status_for(e)
        if code.name == "INTERNAL":
            log.error("unhandled error in a local Speculate stream", exc_info=e)
        self.writer.writelines(frames.pack(frames.ERROR, frames.error_payload(code.name,
                                                                              details)))
        await self.writer.drain()
        self.writer.close()
