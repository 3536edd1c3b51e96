"""Drafter gRPC servicer: protobuf <-> domain types around a DraftEngine.

Each Speculate stream is one verify service's sequence of steps. Messages are
handled in order; decoding, ``engine.step`` and encoding run on one worker
thread shared by all streams (the engine is single threaded), so the event loop
stays free for other RPCs, except for a ``light`` proposer (n-gram lookups:
host work far under a millisecond), whose steps run on the event loop itself:
the hop is on every step's critical path, and the hand-off to a worker and back
costs two thread wake-ups (0.2-0.3 ms measured on a CPU VM). Errors are raised,
never caught here: the server's interceptor maps InvalidRequest / CodecError to
INVALID_ARGUMENT.

Malformed (the stream ends with INVALID_ARGUMENT): a step_id that does not
increase within the stream, plus everything ``engine.check_request`` refuses.
State drift (an unknown sequence, a wrong committed_len) is not an error: the
sequence comes back in ``Proposal.resync``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import grpc

from common import codec, frames, wire
from common.aio import LoopSpinner, in_worker
from common.errors import InvalidRequest
from draft_service.engine import REHEARSAL_SEQ_ID, DraftEngine
from protos.treespec.v1 import treespec_pb2 as pb
from protos.treespec.v1 import treespec_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from draft_service.local_server import LocalServer


# what a rehearsal decodes: one sequence of 8 tokens, an id no verify service uses
_REHEARSAL = pb.SpeculateRequest(step_id=1, sequences=[pb.SequenceUpdate(
    seq_id=REHEARSAL_SEQ_ID, committed_len=8, new_tokens=[1] * 8, full=True)])


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
    def __init__(self, engine: DraftEngine, busy_poll: bool = False,
                 rehearse: bool = False) -> None:
        self.engine = engine
        self._inline = bool(getattr(engine.proposer, "light", False))
        # see common.aio: a rehearsal runs on the loop, so it takes a light proposer
        # through its paces and skips any other (whose real steps run on the worker)
        self._rehearsal = _REHEARSAL.SerializeToString()
        self.pollers: list = []        # mailboxes of local streams (draft_service.local_server)
        self._spinner = LoopSpinner(rehearse=self.rehearse if rehearse else None,
                                    pollers=self.pollers) if busy_poll else None
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft-engine")
        self._staging = codec.Staging()
        self.instance_id = frames.new_instance_id()
        self.local: LocalServer | None = None    # set by the server when it serves one

    async def GetInfo(self, request: pb.DrafterInfoRequest,
                      context: grpc.aio.ServicerContext) -> pb.DrafterInfo:
        info = wire.drafter_info_to_pb(self.engine.info)
        info.instance_id = self.instance_id
        if self.local is not None:
            info.local_socket = self.local.address
        return info

    async def Speculate(self, request_iterator: AsyncIterator[pb.SpeculateRequest],
                        context: grpc.aio.ServicerContext) -> AsyncIterator[pb.Proposal]:
        order = StepOrder()
        async for msg in request_iterator:
            received = time.time_ns()
            order.check(msg.step_id)
            yield await self.answer(msg, received)

    async def answer(self, msg: pb.SpeculateRequest, received_ns: int) -> pb.Proposal:
        """One step of a Speculate stream, whichever carrier brought it (this gRPC
        stream or draft_service.local_server's Unix socket), stamped with when its
        request was read (received_ns) and when the answer leaves."""
        if self._spinner is not None:   # the next step's request is a forward away
            self._spinner.keep_hot()
        if not msg.sequences and not msg.released:      # a warm-up ping (see the proto)
            reply = pb.Proposal(step_id=msg.step_id)
        elif self._inline:
            reply = self._step(msg)
        else:
            reply = await in_worker(self._worker, self._spinner, self._step, msg)
        reply.received_unix_ns = received_ns
        reply.sent_unix_ns = time.time_ns()
        return reply

    def _step(self, msg: pb.SpeculateRequest) -> pb.Proposal:
        batch = self.engine.step(wire.spec_request_from_pb(msg))
        return wire.tree_batch_to_pb(batch, self._staging)

    def spinning_until_ns(self) -> int:
        """Until when (time.monotonic_ns()) the loop spins once a step begins now: 0
        when it does not busy poll."""
        return time.monotonic_ns() + int(self._spinner.hold_s * 1e9) if self._spinner else 0

    def rehearse(self) -> None:
        """This servicer's per-step host work on a throwaway request: decode, the
        engine's checks (and a light proposer's work), encode."""
        req = wire.spec_request_from_pb(pb.SpeculateRequest.FromString(self._rehearsal))
        batch = self.engine.rehearse(req, propose=self._inline)
        wire.tree_batch_to_pb(batch).SerializeToString()

    def close(self) -> None:
        """Stop the worker thread (after the server has stopped)."""
        self._worker.shutdown(wait=True, cancel_futures=True)
