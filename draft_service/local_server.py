"""The Speculate stream on a Unix socket, for a verify service on the same host.

Same messages, same servicer (``DrafterServicer.answer``), same step-id rule and
the same errors as the gRPC stream (``common.grpc_server.status_for``); only the
carrier differs (common/frames.py says why). Each connection is one stream: a
hello frame with the draft's instance id, then one Proposal per SpeculateRequest,
in order. A malformed message ends the connection with an ERROR frame.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

from google.protobuf.message import DecodeError

from common import frames
from common.errors import InvalidRequest
from common.grpc_server import status_for
from draft_service.servicer import DrafterServicer, StepOrder
from protos.treespec.v1 import treespec_pb2 as pb

log = logging.getLogger("treespec.draft.local")


class LocalServer:
    def __init__(self, servicer: DrafterServicer, address: str) -> None:
        self.servicer = servicer
        self.address = address
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
                                                       frames.os_address(self.address))

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
        task = asyncio.current_task()
        self._conns.add(task)
        try:
            writer.writelines(frames.pack(frames.HELLO, self.servicer.instance_id.encode()))
            await self._stream(reader, writer)
        except (ConnectionError, asyncio.CancelledError):
            pass                 # the verify service went away, or we are stopping
        finally:
            self._conns.discard(task)
            writer.close()

    async def _stream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        order = StepOrder()
        while True:
            try:
                try:
                    frame = await frames.read_frame(reader)
                except frames.FrameError as e:
                    raise InvalidRequest(f"broken frame: {e}") from e
                received = time.time_ns()
                if frame is None:
                    return
                kind, payload = frame
                if kind != frames.MESSAGE:
                    raise InvalidRequest(f"expected a SpeculateRequest frame, got kind {kind}")
                try:
                    msg = pb.SpeculateRequest.FromString(payload)
                except DecodeError as e:
                    raise InvalidRequest(f"undecodable SpeculateRequest: {e}") from e
                order.check(msg.step_id)
                reply = await self.servicer.answer(msg, received)
            except (ConnectionError, asyncio.CancelledError):
                raise
            except Exception as e:  # noqa: BLE001 - mapped to an error frame, never swallowed
                code, details = status_for(e)
                if code.name == "INTERNAL":
                    log.exception("unhandled error in a local Speculate stream")
                writer.writelines(frames.pack(frames.ERROR, frames.error_payload(code.name,
                                                                                 details)))
                await writer.drain()
                return
            writer.writelines(frames.pack(frames.MESSAGE, reply.SerializeToString()))
            await writer.drain()
