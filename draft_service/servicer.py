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

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import grpc

from common import codec, wire
from common.aio import LoopSpinner
from common.errors import InvalidRequest
from draft_service.engine import DraftEngine
from protos.treespec.v1 import treespec_pb2 as pb
from protos.treespec.v1 import treespec_pb2_grpc as pb_grpc


class DrafterServicer(pb_grpc.DrafterServicer):
    def __init__(self, engine: DraftEngine, busy_poll: bool = False) -> None:
        self.engine = engine
        self._spinner = LoopSpinner() if busy_poll else None   # see common.aio
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft-engine")
        self._staging = codec.Staging()
        self._inline = bool(getattr(engine.proposer, "light", False))

    async def GetInfo(self, request: pb.DrafterInfoRequest,
                      context: grpc.aio.ServicerContext) -> pb.DrafterInfo:
        return wire.drafter_info_to_pb(self.engine.info)

    async def Speculate(self, request_iterator: AsyncIterator[pb.SpeculateRequest],
                        context: grpc.aio.ServicerContext) -> AsyncIterator[pb.Proposal]:
        loop = asyncio.get_running_loop()
        last: int | None = None
        async for msg in request_iterator:
            if last is not None and msg.step_id <= last:
                raise InvalidRequest(f"step_id {msg.step_id} after {last}: step ids must "
                                     "increase within a Speculate stream")
            last = msg.step_id
            if self._spinner is not None:   # the next step's request is a forward away
                self._spinner.keep_hot()
            yield self._step(msg) if self._inline else \
                await loop.run_in_executor(self._worker, self._step, msg)

    def _step(self, msg: pb.SpeculateRequest) -> pb.Proposal:
        batch = self.engine.step(wire.spec_request_from_pb(msg))
        return wire.tree_batch_to_pb(batch, self._staging)

    def close(self) -> None:
        """Stop the worker thread (after the server has stopped)."""
        self._worker.shutdown(wait=True, cancel_futures=True)
