"""The verify service's end of the Speculate stream: one bidi stream to the draft.

The stream is a gRPC bidi call, or, when the draft advertises a local socket that
this process can reach and that greets with the draft's instance id, the same
messages framed on that Unix socket (common/frames.py: no gRPC thread wakes up on
the hop; ``local=False`` or ``--draft-socket off`` keeps gRPC).

The link hands the engine a proposal for a step or None, never an exception: a
draft that is absent, late, busy or broken only turns that step into plain decode
(the reason is returned for the step's stats). It reconnects in the background,
and each new connection bumps ``epoch`` so the engine resyncs every sequence.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Literal

import grpc
import torch

from common import codec, frames, wire
from common.aio import cancel_and_wait, spin_until
from common.spec_types import DrafterInfo, SeqUpdate, SpecRequest, TreeBatch
from common.tree import validate_tree
from protos.treespec.v1 import treespec_pb2 as pb
from protos.treespec.v1 import treespec_pb2_grpc as pb_grpc

log = logging.getLogger("treespec.verify.draft_link")

Fallback = Literal["no_draft", "disconnected", "busy", "deadline", "invalid_proposal"]
_EXPIRED, _DROPPED = object(), object()     # why a step's wait ended without an answer


def _settle(fut: asyncio.Future, value: object) -> None:
    if not fut.done():
        fut.set_result(value)


class DraftLink:
    def __init__(self, addr: str, reconnect_s: float, vocab_size: int, num_layers: int,
                 busy_poll: bool = False, local: bool = True, mailbox: bool = False) -> None:
        self.addr = addr
        self.reconnect_s = reconnect_s
        self.vocab_size = vocab_size
        self.num_layers = num_layers
        self.info: DrafterInfo | None = None
        self.epoch = 0
        self._call: grpc.aio.StreamStreamCall | frames.FrameStream | None = None
        self._channel: grpc.aio.Channel | None = None
        self._outstanding: int | None = None   # step id still unanswered
        self._waiter: asyncio.Future | None = None   # propose() waiting for that answer
        self._task: asyncio.Task | None = None
        self._staging = codec.Staging()
        self._closed = False
        self.busy_poll = busy_poll      # poll for the answer on the loop, never sleep
        self.local = local              # try the draft's local socket first
        self.mailbox = mailbox          # and ask it for a shared-memory mailbox
        self.carrier = ""               # "unix socket" or "grpc" while connected
        # the last answered step's hop, in time_ns stamps: request handed to the carrier,
        # answer read, and the draft's own (read, sent; 0 from a draft that does not stamp)
        self.stamps: tuple[int, int, int, int] | None = None
        self._t_answer = 0
        self._rehearsal: tuple[DrafterInfo, bytes] | None = None   # (for, proposal bytes)

    @property
    def ready(self) -> bool:
        return self._call is not None and self.info is not None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._connect_loop())

    async def close(self) -> None:
        self._closed = True
        await cancel_and_wait(self._task)
        await self._drop()

    async def _drop(self) -> None:
        call, channel = self._call, self._channel
        self._call = self._channel = None
        self.carrier = ""
        self._outstanding = None
        self._wake(_DROPPED)
        if call is not None:
            call.cancel()
        if channel is not None:
            await channel.close()

    async def _connect_loop(self) -> None:
        while not self._closed:
            try:
                await self._connect_once()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the draft is a cache; any failure means retry later
                log.warning("draft %s unavailable: %s", self.addr, e)
            await self._drop()
            await asyncio.sleep(self.reconnect_s)

    async def _connect_once(self) -> None:
        self._channel = grpc.aio.insecure_channel(self.addr, options=[
            ("grpc.max_send_message_length", 64 << 20),
            ("grpc.max_receive_message_length", 64 << 20)])
        stub = pb_grpc.DrafterStub(self._channel)
        info_pb = await stub.GetInfo(pb.DrafterInfoRequest(), timeout=10)
        info = wire.drafter_info_from_pb(info_pb)
        if info.vocab_size > self.vocab_size:
            raise RuntimeError(f"draft vocabulary {info.vocab_size} exceeds the target's "
                               f"{self.vocab_size}; not using this draft")
        bad = [i for i in info.target_hidden_layers if not 0 <= i <= self.num_layers]
        if bad:
            raise RuntimeError(f"draft wants hidden states of target layers {bad}, but the "
                               f"target has layers 0..{self.num_layers}; not using this draft")
        self.info = info
        self._call = await self._open_local(info_pb) or stub.Speculate()
        self.carrier = "grpc" if not isinstance(self._call, frames.FrameStream) else \
            "unix socket + mailbox" if self._call.mailbox is not None else "unix socket"
        self.epoch += 1
        log.info("draft %s connected: %s, envelope %s, steps by %s", self.addr, info.proposer,
                 info.envelope, self.carrier)
        async for msg in self._call:
            self._deliver(msg)
        raise RuntimeError("draft closed the Speculate stream")

    async def _open_local(self, info: pb.DrafterInfo) -> frames.FrameStream | None:
        """The draft's local socket, when it advertises one and it answers as that draft."""
        if not (self.local and info.local_socket and info.instance_id):
            return None
        for mailbox in ([True, False] if self.mailbox else [False]):
            try:
                return await frames.FrameStream.open(info.local_socket, info.instance_id,
                                                     pb.Proposal.FromString, mailbox=mailbox)
            except (OSError, asyncio.TimeoutError, frames.FrameError) as e:
                log.info("draft's local socket %s%s not usable here (%s)", info.local_socket,
                         " with a mailbox" if mailbox else "", e)
        log.info("steps by gRPC")
        return None

    def rehearse(self) -> None:
        """The hop's host work on throwaway data (common.aio.LoopSpinner keeps it warm):
        encode a one-sequence request, decode and check a chain proposal."""
        info = self.info
        if info is None or self._waiter is not None:     # not while a step waits: the
            return                                        # answer would wait for it
        if self._rehearsal is None or self._rehearsal[0] is not info:
            n = info.envelope.num_nodes
            answer = pb.Proposal(step_id=1, seq_ids=[1], tokens=codec.encode(
                torch.zeros(1, n, dtype=torch.int32)), parents=codec.encode(
                torch.arange(-1, n - 1, dtype=torch.int32).view(1, n)))
            self._rehearsal = (info, answer.SerializeToString())
        req = SpecRequest(1, [SeqUpdate(seq_id=1, committed_len=9, new_tokens=[1, 2, 3, 4],
                                        accepted_nodes=[0, 1, 2], accepted_step_id=0)])
        wire.spec_request_to_pb(req).SerializeToString()
        tree = wire.tree_batch_from_pb(pb.Proposal.FromString(self._rehearsal[1]))
        if validate_tree(tree.tokens, tree.parents, info.envelope.num_nodes,
                         self.vocab_size) is not None:
            raise RuntimeError("the rehearsal's own proposal failed its checks")

    def _poll(self) -> bool:
        """Deliver an answer waiting in the mailbox; whether there was one."""
        call = self._call
        msg = call.poll() if isinstance(call, frames.FrameStream) else None
        if msg is not None:
            self._deliver(msg)
        return msg is not None

    def _deliver(self, msg: pb.Proposal) -> None:
        """Hand the awaited answer to propose(); a late answer to a step that already
        timed out only frees the draft for the next step (never applied)."""
        if msg.step_id != self._outstanding:
            return
        if self._waiter is not None and not self._waiter.done():
            self._t_answer = time.time_ns()
            self._waiter.set_result(msg)
        else:
            self._outstanding = None

    def _wake(self, value: object) -> None:
        """End propose()'s wait, if one is on, with value."""
        if self._waiter is not None:
            _settle(self._waiter, value)

    async def propose(self, req: SpecRequest, timeout_s: float) -> TreeBatch | Fallback:
        """Send one step's request and wait up to timeout_s for its proposal.

        One future per step, completed by the stream reader, by a timer at the
        deadline or by a dropped connection: no queue and no extra task per step."""
        self.stamps = None
        if not self.ready:
            return "disconnected"
        self._poll()                 # a late answer may be waiting in the mailbox
        if self._outstanding is not None:
            return "busy"            # the draft is still on a step that timed out
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        self._outstanding = req.step_id
        timer = loop.call_later(timeout_s, _settle, waiter, _EXPIRED)
        try:
            msg_out = wire.spec_request_to_pb(req, self._staging)
            t_sent = time.time_ns()                 # handed to the carrier
            polling = self.busy_poll and isinstance(self._call, frames.FrameStream)
            if polling:
                self._call.waiting(True)      # a mailbox, if any, gets the answer
            await self._call.write(msg_out)
            if self.busy_poll:
                await spin_until(lambda: self._poll() or waiter.done())
            if polling:
                self._call.waiting(False)
            msg = await waiter
        except Exception as e:
            log.warning("draft write failed: %s", e)
            self._outstanding = None
            return "disconnected"
        finally:
            timer.cancel()
            self._waiter = None
        if msg is _EXPIRED:
            return "deadline"
        if msg is _DROPPED:
            return "disconnected"
        self._outstanding = None
        self.stamps = (t_sent, self._t_answer, msg.received_unix_ns, msg.sent_unix_ns)
        try:
            return wire.tree_batch_from_pb(msg)
        except codec.CodecError as e:
            log.warning("draft sent an undecodable proposal: %s", e)
            return "invalid_proposal"
