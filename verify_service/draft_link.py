"""The draft service as a Drafter: one Speculate stream, reconnected as needed.

The stream runs over the draft's local Unix socket when it advertises one that this
process reaches and that greets with the draft's instance id (common/wire/frames.py; the
same host), else over gRPC (``local=False``: always gRPC): the socket wakes no gRPC
thread on the step's critical path. With ``busy_poll`` the wait for the answer is a
loop that never sleeps: no thread wake-up either.

A draft that is absent, late, busy or broken only turns that step into plain
decode: ``propose`` returns the reason, never raises. Each new connection resets
the DraftSync, so every sequence is sent in full again.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from treespec.common.wire import codec, frames, convert as wire
from treespec.common.serving.aio import cancel_and_wait, spin_until
from treespec.common.serving.grpc_server import MESSAGE_LIMITS
from treespec.common.serving.auth import metadata
from treespec.common.spec.messages import DrafterInfo
from treespec.common.spec.tree import TreeBatch
from treespec.common.serving.tls import ClientTLS, channel
from treespec.protos.treespec.v1 import treespec_pb2 as pb
from treespec.protos.treespec.v1 import treespec_pb2_grpc as pb_grpc
from treespec.verify_service.draft_connect import attach_shared, fetch_projection, open_local
from treespec.verify_service.draft_sync import DraftSync, Outgoing
from treespec.verify_service.drafter import Drafted
from treespec.verify_service.sequence import Sequence

log = logging.getLogger("treespec.verify.draft_link")

# a request bringing the draft this many new tokens measures its catch-up rate (a
# smaller one's answer time is mostly the drafting itself)
MEASURE_CATCH_UP = 1024

_EXPIRED, _DROPPED = object(), object()     # why a step's wait ended without an answer


def _settle(fut: asyncio.Future, value: object) -> None:
    if not fut.done():
        fut.set_result(value)


class DraftLink:
    def __init__(self, addr: str, reconnect_s: float, deadline_s: float, vocab_size: int,
                 num_layers: int, busy_poll: bool = False, local: bool = True,
                 rejection: bool = False, tls: ClientTLS | None = None,
                 api_key: str | None = None) -> None:
        self.addr = addr
        self.tls = tls
        self._md = metadata(api_key)
        self.reconnect_s = reconnect_s
        self.deadline_s = deadline_s
        self.vocab_size = vocab_size
        self.num_layers = num_layers
        self.busy_poll = busy_poll
        self.local = local
        self.sync = DraftSync(rejection=rejection)
        self.carrier = ""                      # "unix socket" or "grpc" while connected
        self._info: DrafterInfo | None = None
        self._call: grpc.aio.StreamStreamCall | frames.FrameStream | None = None
        self._channel: grpc.aio.Channel | None = None
        self._outstanding: int | None = None   # step id still unanswered
        self._waiter: asyncio.Future | None = None
        self._task: asyncio.Task | None = None
        self._t_answer = 0
        self._late = 0                       # steps whose answer missed the deadline
        # new tokens a second the draft takes in, measured on answers to requests that
        # brought it at least MEASURE_CATCH_UP (None: not yet): predicts late answers
        self.catch_up_rate: float | None = None
        self._sent = (0, 0, 0)               # the last request: step id, new tokens, ns
        # the last request no step waited for (sent so, or past its deadline), whether
        # it brought a new prompt, and the draft's time on such requests: (returning
        # sequences, new prompts)
        self._blind, self._blind_fresh = 0, False
        self.unwaited_s = [0.0, 0.0]
        # the catch-up request outstanding (answered: done), and the hidden-state bytes
        # catch-ups carried since the last step's answer counted them
        self._caught: asyncio.Future | None = None
        self._caught_bytes = 0
        self._down: str | None = None          # why the draft is unreachable, last logged
        # the lookahead awaited (it follows the answer to this step), set once it lands
        self._ahead_step: int | None = None
        self._ahead: asyncio.Future | None = None
        self._closed = False

    @property
    def info(self) -> DrafterInfo | None:
        return self._info

    @property
    def ready(self) -> bool:
        return self._call is not None and self._info is not None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._connect_loop())

    async def close(self) -> None:
        self._closed = True
        await cancel_and_wait(self._task)
        await self._drop()

    def release(self, seq_ids: list[int]) -> None:
        self.sync.release(seq_ids)

    def prefix_held(self, keys: list[bytes]) -> int:
        return self.sync.prefix_held(keys) if self.ready else 0

    async def idle(self) -> None:
        """Send what ended as a request of no sequences. Nothing waits for its answer:
        the draft takes requests in order, so the next step's request queues behind it
        there and is waited for as any step's is."""
        if not (self.ready and self.sync.has_released and self._outstanding is None):
            return
        out = self.sync.request([], False, {})
        try:
            await self._call.write(wire.spec_request_to_pb(out.request, self.sync.shared))
        except Exception as e:  # noqa: BLE001 - the connect loop sees the broken link
            log.debug("release notice not sent: %s", e)
        self.sync.sent([], out)

    async def _drop(self) -> None:
        call, channel = self._call, self._channel
        self._call = self._channel = None
        self.carrier = ""
        self.sync.use_shared(None)
        self._outstanding = None
        if self._waiter is not None:
            _settle(self._waiter, _DROPPED)
        if self._ahead is not None:
            _settle(self._ahead, None)
        self._ahead_step = self._ahead = None
        if self._caught is not None:
            _settle(self._caught, None)
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
                self._log_down(e)
            await self._drop()
            await asyncio.sleep(self.reconnect_s)

    def _log_down(self, e: Exception) -> None:
        """One line per change of the reason the draft is unreachable (retries are quiet)."""
        why = (f"{e.code().name}: {e.details()}" if isinstance(e, grpc.aio.AioRpcError)
               else str(e)).splitlines()[0]
        if any(w in why.lower() for w in ("ssl", "handshake", "certificate", "tls")):
            why += (" (TLS: check --draft-tls-ca/--draft-tls-cert/--draft-tls-key against "
                    "the draft's --tls-cert and --tls-client-ca)")
        if why != self._down:
            log.warning("draft %s unavailable, serving plain decode until it is back "
                        "(retrying every %gs): %s", self.addr, self.reconnect_s, why)
            self._down = why

    async def _connect_once(self) -> None:
        self._channel = channel(self.addr, self.tls, MESSAGE_LIMITS)
        stub = pb_grpc.DrafterStub(self._channel)
        info_pb = await stub.GetInfo(pb.DrafterInfoRequest(), timeout=10, metadata=self._md)
        info = wire.drafter_info_from_pb(info_pb)
        if info.vocab_size > self.vocab_size:
            raise RuntimeError(f"draft vocabulary {info.vocab_size} exceeds the target's "
                               f"{self.vocab_size}; not using this draft")
        bad = [i for i in info.target_hidden_layers if not 0 <= i <= self.num_layers]
        if bad:
            raise RuntimeError(f"draft wants hidden states of target layers {bad}, but the "
                               f"target has layers 0..{self.num_layers}; not using this draft")
        projection = await fetch_projection(stub, info, self._md)
        self._info = info
        self._call = (await open_local(info_pb) if self.local else None) \
            or stub.Speculate(metadata=self._md)
        self.carrier = "unix socket" if isinstance(self._call, frames.FrameStream) else "grpc"
        self.sync.reset(attach_shared(self._call, info), projection)
        self.sync.lookahead = info.lookahead
        self.catch_up_rate, self._down = None, None     # another draft: measured afresh
        log.info("draft %s connected: %s, envelope %s, steps by %s%s%s%s", self.addr,
                 info.proposer, info.envelope, self.carrier,
                 ", hidden states through shared memory" if self.sync.shared else "",
                 ", projected" if projection is not None else "",
                 f", lookahead {info.lookahead}" if info.lookahead else "")
        async for msg in self._call:
            self._deliver(msg)
        raise RuntimeError("draft closed the Speculate stream")

    async def _send_only(self, seqs: list[Sequence], out: Outgoing) -> Drafted:
        """A request whose every row is still being synced (its trees would go unused),
        or whose catch-up the draft is predicted to take past the step's cost or half
        the deadline (a batch of new prompts, sequences back from a rest: new tokens
        over the measured catch_up_rate): sent without waiting, so the step decodes
        plain while the draft takes it in (the answer only frees the draft for the next
        request)."""
        self._outstanding = step = out.request.step_id
        self._blind, self._blind_fresh = step, out.fresh
        try:
            await self._call.write(wire.spec_request_to_pb(out.request, self.sync.shared))
        except Exception as e:
            log.warning("draft write failed: %s", e)
            self._outstanding = None
        finally:
            self.sync.sent(seqs, out)
        return Drafted(None, step_id=out.request.step_id, syncing=out.syncing,
                       hidden_bytes=out.hidden_bytes, catch_up=True, fresh=out.fresh)

    def _deliver(self, msg: pb.Proposal) -> None:
        """Hand the awaited answer to propose(); an answer nobody waits for (late, or
        to a request sent without waiting) frees the draft for the next step, and only
        its resync list is applied. The draft's time on a request no step waited for (sent
        without waiting, or past its deadline) adds to unwaited_s, new prompts' apart: on
        a GPU it shares, the steps beside it paid for it."""
        if msg.lookahead:
            self._take_ahead(msg)
            return
        if msg.step_id != self._outstanding:
            return
        step, new, t_sent = self._sent
        took = max(1e-6, (time.time_ns() - t_sent) * 1e-9) if step == msg.step_id else 0.0
        if took and new >= MEASURE_CATCH_UP:
            self.catch_up_rate = new / took if self.catch_up_rate is None else \
                0.5 * (self.catch_up_rate + new / took)
        if msg.step_id == self._blind:
            self.unwaited_s[self._blind_fresh] += took
        if self._waiter is not None and not self._waiter.done():
            self._t_answer = time.time_ns()
            self._waiter.set_result(msg)
        else:
            self._outstanding = None
            self.sync.resync(list(msg.resync))
            self.sync.lose(list(msg.lost_prefix))
            if self._caught is not None:
                _settle(self._caught, None)

    def _take_ahead(self, msg: pb.Proposal) -> None:
        """The lookahead awaited, kept for the next step (a late or undecodable one is
        dropped: that step drafts as usual)."""
        if msg.step_id != self._ahead_step:
            return
        try:
            ahead = wire.lookahead_from_pb(msg, self._info.lookahead)
        except codec.CodecError as e:
            log.warning("draft sent an undecodable lookahead: %s", e)
            ahead = None
        self.sync.take_ahead(ahead)
        self._ahead_step = None
        if self._ahead is not None:
            _settle(self._ahead, ahead)

    async def _await_ahead(self) -> bool:
        """The lookahead that follows the last step's answer, waited for up to the
        deadline (the draft drafted it while the target verified: in time, it is here);
        whether it missed the deadline."""
        fut = self._ahead
        late = False
        if fut is None:
            return late
        if not fut.done():
            try:
                if self.busy_poll:
                    await asyncio.wait_for(spin_until(fut.done), self.deadline_s)
                else:
                    await asyncio.wait_for(asyncio.shield(fut), self.deadline_s)
            except asyncio.TimeoutError:
                self._ahead_step = None             # too late to use: dropped when it lands
                self.sync.take_ahead(None)
                late = True
        self._ahead = None
        return late

    def _expect_ahead(self, out: Outgoing | None) -> None:
        """The next step waits for the lookahead out asks for (None, or one asking for
        none: it waits for none, and none is used)."""
        if out is not None and out.asks_ahead:
            self._ahead_step = out.request.step_id
            self._ahead = asyncio.get_running_loop().create_future()
        else:
            self._ahead_step = self._ahead = None
            self.sync.take_ahead(None)

    def take_unwaited(self) -> tuple[float, float]:
        """See treespec.verify_service.drafter.Drafter.take_unwaited."""
        spent, self.unwaited_s = tuple(self.unwaited_s), [0.0, 0.0]
        return spent

    async def catch_up(self, seqs: list[Sequence]) -> None:
        """What the draft lacks of the prompts still crossing (DraftSync.catch_up), sent
        in a request nobody waits for, when no request is outstanding: the draft takes it
        in while the target runs the step and the next prefill, and the next step's
        request waits for its answer (at most a step's cost) rather than finding the
        draft busy. seqs: those the draft may speculate on, prefilling ones included."""
        if not (self.ready and self._info.target_hidden_layers) \
                or self._outstanding is not None:
            return
        out = self.sync.catch_up(seqs)
        if out is None:
            return
        self._sent = (out.request.step_id, sum(len(u.new_tokens) for u in out.request.seqs),
                      time.time_ns())
        self._caught_bytes += out.hidden_bytes
        self._caught = asyncio.get_running_loop().create_future()
        await self._send_only(seqs, out)
        if self._outstanding is None:       # not sent
            self._caught = None

    async def _await_caught(self, step_s: float | None) -> None:
        """The outstanding catch-up's answer, waited for at most the step's cost (or half
        the deadline): the draft answers requests in order, so a step asked behind a
        catch-up would wait for it there anyway."""
        fut = self._caught
        if fut is None or fut.done():
            self._caught = None
            return
        wait = self.deadline_s / 2 if step_s is None else min(step_s, self.deadline_s / 2)
        try:
            if self.busy_poll:
                await asyncio.wait_for(spin_until(fut.done), wait)
            else:
                await asyncio.wait_for(asyncio.shield(fut), wait)
        except asyncio.TimeoutError:
            return
        self._caught = None

    async def propose(self, seqs: list[Sequence], trace: dict[str, str],
                      depth: int = 0, step_s: float | None = None) -> Drafted:
        """_propose's answer, counting the hidden states catch-ups carried since the last."""
        got = await self._propose(seqs, trace, depth, step_s)
        got.hidden_bytes += self._caught_bytes
        self._caught_bytes = 0
        return got

    async def _propose(self, seqs: list[Sequence], trace: dict[str, str],
                       depth: int = 0, step_s: float | None = None) -> Drafted:
        """Send one step's request and wait up to the deadline for its answer: one
        future, completed by the stream reader, a timer or a dropped connection.
        step_s: what the step costs, when known: a catch-up predicted longer is sent
        without waiting (waiting, the whole batch commits nothing meanwhile). With
        lookahead, the candidates drafted while the last step verified are waited for
        first; a sequence whose outcome is among them takes that tree, and a request
        whose every sequence does is sent without waiting for its answer."""
        if not self.ready:
            return Drafted(None, "disconnected")
        t_wait = time.perf_counter()
        ahead_late = await self._await_ahead()
        waited = time.perf_counter() - t_wait
        await self._await_caught(step_s)
        if self._outstanding is not None:
            return Drafted(None, "busy")     # the draft is still on a step that timed out
        out = self.sync.request(seqs, bool(self._info.target_hidden_layers), trace, depth)
        self.sync.price.step(len(out.hits), out.misses + ahead_late, waited)
        step = out.request.step_id
        new = sum(len(u.new_tokens) for u in out.request.seqs)
        self._sent = (step, new, time.time_ns())
        if out.rows and set(out.rows) <= set(out.syncing):
            self.sync.take_ahead(None)
            return await self._send_only(seqs, out)
        if not out.rows:                    # every row still crossing in catch-ups
            self.sync.take_ahead(None)
            self._expect_ahead(None)
            return Drafted(None, step_id=step, syncing=out.syncing, catch_up=True,
                           fresh=out.fresh)
        self._expect_ahead(out)
        if out.rows and len(out.hits) == len(out.rows):
            return await self._send_ahead(seqs, out)
        late = self.deadline_s / 2 if step_s is None else min(step_s, self.deadline_s / 2)
        if (self.catch_up_rate and out.catch_up(self._info.envelope.depth)
                and new / self.catch_up_rate > late):
            out.syncing = sorted({*out.syncing, *out.rows})  # too late to wait for
            self._expect_ahead(None)
            return await self._send_only(seqs, out)
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        self._outstanding = step
        timer = loop.call_later(self.deadline_s, _settle, waiter, _EXPIRED)
        try:
            msg_out = wire.spec_request_to_pb(out.request, self.sync.shared)
            t_sent = time.time_ns()
            await self._call.write(msg_out)
            if self.busy_poll:
                await spin_until(waiter.done)
            msg = await waiter
        except Exception as e:
            log.warning("draft write failed: %s", e)
            msg = _DROPPED
        finally:
            timer.cancel()
            self._waiter = None
            self.sync.sent(seqs, out)
        if msg is _EXPIRED or msg is _DROPPED:
            self._expect_ahead(None)        # the lookahead after a late answer: unused
            if msg is _DROPPED:
                self._outstanding = None
            else:                           # its time counts once it answers
                self._blind, self._blind_fresh = step, out.fresh
                self._late += 1
                if self._late in (1, 10) or self._late % 100 == 0:
                    log.info("draft step %d missed the %.0f ms deadline (%d so far): "
                             "plain decode until it answers; --step-deadline-ms sets it",
                             step, 1000 * self.deadline_s, self._late)
            return Drafted(None, "deadline" if msg is _EXPIRED else "disconnected", step_id=step,
                           hidden_bytes=out.hidden_bytes)
        self._outstanding = None
        stamps = (t_sent, self._t_answer, msg.received_unix_ns, msg.sent_unix_ns)
        if not out.catch_up(self._info.envelope.depth):
            self.sync.price.answered((self._t_answer - t_sent) * 1e-9)
        try:
            resp = wire.response_from_pb(msg)
        except codec.CodecError as e:
            log.warning("draft sent an undecodable proposal: %s", e)
            return Drafted(None, "invalid_proposal", step_id=step, stamps=stamps,
                           hidden_bytes=out.hidden_bytes)
        if resp.seq_ids != [seqs[i].seq_id for i in out.rows]:
            log.warning("dropping a proposal whose rows are not the request's sequences")
            return Drafted(None, "invalid_proposal", step_id=step, stamps=stamps,
                           hidden_bytes=out.hidden_bytes)
        self.sync.resync(resp.resync)
        self.sync.lose(resp.lost_prefix)
        trees, syncing = resp.trees, set(out.syncing)
        if not self.sync.rejection:         # coupled acceptance never reads q
            trees.q_ids = trees.q_probs = None
        for j, i in enumerate(out.rows):    # a hit's row came padding: the candidate
            if i in out.hits and j < len(trees):
                trees.tokens[j] = out.ahead.trees.tokens[out.hits[i]]
                trees.parents[j] = out.ahead.trees.parents[out.hits[i]]
        keep = [j for j, i in enumerate(out.rows) if i not in syncing]
        return Drafted(trees.take(keep) if syncing else trees, step_id=step, stamps=stamps,
                       syncing=out.syncing, hidden_bytes=out.hidden_bytes,
                       catch_up=out.catch_up(self._info.envelope.depth), fresh=out.fresh,
                       rows=[out.rows[j] for j in keep], lookahead_hits=len(out.hits),
                       lookahead_misses=out.misses)

    async def _send_ahead(self, seqs: list[Sequence], out: Outgoing) -> Drafted:
        """A request whose every row's tree is a lookahead candidate: nothing to wait
        for, so it is sent and the step goes on (its answer, all padding, only frees the
        draft; the lookahead that follows is what the next step waits for)."""
        self._outstanding = out.request.step_id
        t_sent = time.time_ns()
        try:
            await self._call.write(wire.spec_request_to_pb(out.request, self.sync.shared))
        except Exception as e:
            log.warning("draft write failed: %s", e)
            self._outstanding = None
            return Drafted(None, "disconnected", step_id=out.request.step_id)
        finally:
            self.sync.sent(seqs, out)
        rows = sorted(out.hits)
        t = out.ahead.trees.take([out.hits[i] for i in rows])
        return Drafted(TreeBatch(t.tokens.clone(), t.parents.clone()),
                       step_id=out.request.step_id, stamps=(t_sent, t_sent, 0, 0),
                       syncing=out.syncing, rows=rows, lookahead_hits=len(rows))
