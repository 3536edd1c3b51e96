"""Drafter gRPC servicer: protobuf <-> domain types around a DraftEngine.

Each Speculate stream is one verify service's sequence of steps. Messages are
handled in order; decoding, ``engine.step`` and encoding run on one worker
thread shared by all streams (the engine is single threaded), so the event loop
stays free for other RPCs, except for a ``light`` proposer (n-gram lookups:
host work far under a millisecond), whose steps run on the event loop itself:
the hop is on every step's critical path, and the hand-off to a worker and back
costs two thread wake-ups. With ``--lookahead`` an answer is followed by a second
message, the next step's candidate trees (draft_service/lookahead.py), drafted after
the answer has left. Errors are raised, never caught here: the server's
interceptor maps InvalidRequest / CodecError to INVALID_ARGUMENT.

Malformed (the stream ends with INVALID_ARGUMENT): a step_id that does not
increase within the stream, plus everything ``engine.check_request`` refuses.
State drift (an unknown sequence, a wrong committed_len) is not an error: the
sequence comes back in ``Proposal.resync``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
import grpc

from treespec.common.wire import codec, frames, convert as wire
from treespec.common.serving.errors import InvalidRequest
from treespec.common.spec.messages import SpecRequest
from treespec.common.wire.shared_buffer import SharedBuffer
from treespec.draft_service.engine import DraftEngine
from treespec.protos.treespec.v1 import treespec_pb2 as pb
from treespec.protos.treespec.v1 import treespec_pb2_grpc as pb_grpc


PROJECTION_BLOCK_BYTES = 4 << 20


class StepOrder:
    """Step ids must increase within one stream (on either carrier)."""

    def __init__(self) -> None:
        self.last: int | None = None

    def check(self, step_id: int) -> None:
        if self.last is not None and step_id <= self.last:
            raise InvalidRequest(f"step_id {step_id} after {self.last}: step ids must "
                                 "increase within a Speculate stream")
        self.last = step_id


class DrafterServicer(pb_grpc.DrafterServicer):
    def __init__(self, engine: DraftEngine) -> None:
        self.engine = engine
        self._inline = bool(getattr(engine.proposer, "light", False))
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft-engine")
        self.instance_id = frames.new_instance_id()
        self.local_socket: str | None = None     # its address, when the server serves one

    async def GetInfo(self, request: pb.DrafterInfoRequest,
                      context: grpc.aio.ServicerContext) -> pb.DrafterInfo:
        info = wire.drafter_info_to_pb(self.engine.info)
        info.instance_id = self.instance_id
        if self.local_socket is not None:
            info.local_socket = self.local_socket
        return info

    async def GetProjection(self, request: pb.ProjectionRequest,
                            context: grpc.aio.ServicerContext) -> AsyncIterator[pb.Tensor]:
        """DrafterInfo.projected_width's projection in blocks of rows (the proto's
        GetProjection); nothing where it announces none."""
        if not self.engine.info.projected_width:
            return
        w = self.engine.proposer.projection.detach()
        rows = max(1, PROJECTION_BLOCK_BYTES // (w.shape[1] * w.element_size()))
        for at in range(0, w.shape[0], rows):
            yield codec.encode(w[at:at + rows].cpu())

    async def Speculate(self, request_iterator: AsyncIterator[pb.SpeculateRequest],
                        context: grpc.aio.ServicerContext) -> AsyncIterator[pb.Proposal]:
        order = StepOrder()
        async for msg in request_iterator:
            received = time.time_ns()
            order.check(msg.step_id)
            reply, req = await self.answer(msg, received)
            yield reply
            ahead = await self.lookahead(req)
            if ahead is not None:
                yield ahead

    async def answer(self, msg: pb.SpeculateRequest, received_ns: int,
                     shared: SharedBuffer | None = None
                     ) -> tuple[pb.Proposal, SpecRequest | None]:
        """One step of a Speculate stream, whichever carrier brought it (this gRPC
        stream or treespec.draft_service.local_server's Unix socket, with its shared buffer),
        stamped with when its request was read (received_ns) and when the answer
        leaves; and the request as the engine took it (None for a no-op)."""
        req = None
        if not msg.sequences and not msg.released:      # a no-op (see the proto)
            reply = pb.Proposal(step_id=msg.step_id)
        elif self._inline:
            reply, req = self._step(msg, shared)
        else:
            reply, req = await asyncio.get_running_loop().run_in_executor(
                self._worker, self._step, msg, shared)
        reply.received_unix_ns = received_ns
        reply.sent_unix_ns = time.time_ns()
        return reply, req

    async def lookahead(self, req: SpecRequest | None) -> pb.Proposal | None:
        """The lookahead that follows the step req, once its answer has left (None: it
        asked for none); the verify service runs that step meanwhile, and the stream's
        next request waits for this."""
        if req is None or not self.engine.lookahead_k:
            return None
        if self._inline:
            ahead = self.engine.lookahead(req)
        else:
            ahead = await asyncio.get_running_loop().run_in_executor(
                self._worker, self.engine.lookahead, req)
        if ahead is None:
            return None
        reply = wire.lookahead_to_pb(ahead)
        reply.sent_unix_ns = time.time_ns()
        return reply

    def _step(self, msg: pb.SpeculateRequest, shared: SharedBuffer | None = None
              ) -> tuple[pb.Proposal, SpecRequest]:
        req = wire.spec_request_from_pb(msg, shared)
        return wire.response_to_pb(self.engine.step(req)), req

    def close(self) -> None:
        """Stop the worker thread (after the server has stopped)."""
        self._worker.shutdown(wait=True, cancel_futures=True)
