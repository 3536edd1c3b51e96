"""The verify side's DraftLink against a real gRPC drafter that answers on a script:
an answer in time is returned, a late one gives "deadline", the step after it is
"busy" until that late answer lands (and is never applied), then the link serves
again; a drafter that goes away mid-wait gives "disconnected" at once, not at the
deadline; a release notice's slow answer does not make the next step plain."""

from __future__ import annotations

import asyncio
import time

import grpc
import torch

from treespec.common.wire import codec
from treespec.common.serving.grpc_server import start_server
from treespec.common.spec.messages import DrafterInfo
from treespec.common.spec.tree import PRESETS, TreeBatch
from treespec.common.wire.convert import drafter_info_to_pb
from treespec.protos.treespec.v1 import treespec_pb2 as pb
from treespec.protos.treespec.v1 import treespec_pb2_grpc as pb_grpc
from treespec.verify_service.draft_link import DraftLink
from treespec.verify_service.request import GenRequest
from treespec.verify_service.sequence import Sequence

ENV = PRESETS["chain4"]


class ScriptedDrafter(pb_grpc.DrafterServicer):
    """Answers step s after delays[s] seconds (0 when absent) with tokens all equal to s;
    a delay of None ends the stream with the step unanswered."""

    def __init__(self, delays: dict[int, float | None]) -> None:
        self.delays = delays
        self.gone = asyncio.Event()

    async def GetInfo(self, request, context):
        return drafter_info_to_pb(DrafterInfo(ENV, 64, "scripted"))

    async def Speculate(self, request_iterator, context):
        async for req in request_iterator:
            delay = self.delays.get(req.step_id, 0.0)
            if delay is None:
                self.gone.set()
                await context.abort(grpc.StatusCode.UNAVAILABLE, "going away")
            await asyncio.sleep(delay)
            b = len(req.sequences)
            tokens = torch.full((b, ENV.num_nodes), req.step_id, dtype=torch.int32)
            parents = torch.arange(-1, ENV.num_nodes - 1, dtype=torch.int32).repeat(b, 1)
            yield pb.Proposal(step_id=req.step_id, seq_ids=[s.seq_id for s in req.sequences],
                              tokens=codec.encode(tokens), parents=codec.encode(parents))


SEQ = Sequence(GenRequest(prompt_ids=(1, 2, 3), max_tokens=100), frozenset(), 1000)


async def _propose(link: DraftLink, deadline_s: float):
    """One step for SEQ (one token committed after each), its answer as the engine
    sees it: the trees with their step id, or the fallback reason."""
    link.deadline_s = deadline_s
    got = await link.propose([SEQ], {})
    SEQ.commit([4])
    if got.trees is None:
        return got.fallback
    tree = TreeBatch(got.trees.tokens, got.trees.parents)
    tree.step_id = got.step_id
    return tree


async def _linked(drafter: ScriptedDrafter):
    server, port = await start_server(
        "127.0.0.1", 0, lambda s: pb_grpc.add_DrafterServicer_to_server(drafter, s),
        ["treespec.v1.Drafter"])
    link = DraftLink(f"127.0.0.1:{port}", reconnect_s=30, deadline_s=1.0, vocab_size=64,
                     num_layers=2)
    link.start()
    for _ in range(250):
        if link.ready:
            break
        await asyncio.sleep(0.02)
    assert link.ready
    return server, link


def test_late_answers_give_deadline_then_busy_and_are_never_applied():
    async def go():
        server, link = await _linked(ScriptedDrafter({2: 0.4}))
        try:
            got = [await _propose(link, 1.0)]
            got.append(await _propose(link, 0.1))               # answered at 0.4 s
            got.append(await _propose(link, 1.0))               # step 2 still running
            await asyncio.sleep(0.5)                            # its answer lands
            got.append(link.take_unwaited())                    # no step waited for it
            got.append(await _propose(link, 1.0))
            return got
        finally:
            await link.close()
            await server.stop(0.2)

    first, late, busy, unwaited, after = asyncio.run(go())
    assert isinstance(first, TreeBatch) and first.step_id == 1
    assert late == "deadline" and busy == "busy"
    assert 0.35 < unwaited[0] < 0.9 and unwaited[1] == 0.0     # a try's cost for the controller
    assert isinstance(after, TreeBatch) and after.step_id == 3
    assert bool((after.tokens == 3).all())      # step 2's late tree was dropped


def test_a_slow_answer_to_a_release_notice_does_not_make_the_next_step_plain():
    """Going idle, the link tells the draft what ended (a request of no sequences). The
    next step's request queues behind that notice at the draft and is waited for: its
    trees are used, not given up as "busy" while the notice's answer is still out."""
    async def go():
        server, link = await _linked(ScriptedDrafter({2: 0.4}))
        other = Sequence(GenRequest(prompt_ids=(5, 6, 7), max_tokens=100), frozenset(),
                         1000, seq_id=3000)
        try:
            first = await _propose(link, 1.0)
            link.release([SEQ.seq_id])
            await link.idle()                                   # step 2, answered at 0.4 s
            link.deadline_s = 5.0
            t0 = time.perf_counter()
            nxt = await link.propose([other], {})
            return first, nxt, time.perf_counter() - t0
        finally:
            await link.close()
            await server.stop(0.2)

    first, nxt, waited = asyncio.run(go())
    assert isinstance(first, TreeBatch)
    assert nxt.fallback is None and nxt.step_id == 3 and bool((nxt.trees.tokens == 3).all())
    assert waited >= 0.3                        # it came after the notice's answer


def test_a_drafter_going_away_mid_wait_is_disconnected_at_once():
    async def go():
        drafter = ScriptedDrafter({2: None})
        server, link = await _linked(drafter)
        try:
            assert isinstance(await _propose(link, 5.0), TreeBatch)
            t0 = time.perf_counter()
            why = await _propose(link, 5.0)
            return why, time.perf_counter() - t0, link.ready
        finally:
            await link.close()
            await server.stop(0.2)

    why, waited, ready = asyncio.run(go())
    assert why == "disconnected" and waited < 2.0 and not ready


def test_a_catch_up_predicted_late_is_sent_without_waiting():
    """The draft's catch-up rate is measured on a long prompt's answer; a later request
    whose catch-up it predicts past half the deadline is sent without waiting (the step
    decodes plain at once, its row syncing) instead of waiting out the deadline. The
    draft's time on such a request is kept for the controller (a try's cost), apart
    for requests that bring a new prompt. Given the
    step's cost, a catch-up predicted longer than that step is not waited for either,
    however long the deadline (the batch would commit nothing meanwhile)."""
    def seq(i: int) -> Sequence:
        return Sequence(GenRequest(prompt_ids=tuple(range(1, 61)) * 20, max_tokens=2000),
                        frozenset(), 4000, seq_id=2000 + i)

    async def go():
        server, link = await _linked(ScriptedDrafter({1: 0.3, 2: 0.3, 3: 0.3, 4: 0.3}))
        back = seq(0)
        try:
            first = await link.propose([back], {})              # 1200 tokens in ~0.3 s
            rate = link.catch_up_rate
            link.deadline_s = 0.5                               # ~0.3 s > 0.25 s: late
            t0 = time.monotonic()
            second = await link.propose([seq(1)], {})           # a new prompt
            waited = time.monotonic() - t0
            await asyncio.sleep(0.5)                            # its answer lands
            fresh = link.take_unwaited()
            back.commit([7] * 1200)                             # back from a long rest
            third = await link.propose([back], {})
            await asyncio.sleep(0.5)
            spent, again = link.take_unwaited(), link.take_unwaited()
            back.commit([7] * 1200)
            link.deadline_s = 10.0
            fourth = await link.propose([back], {}, 0, 0.05)    # ~0.3 s > a 50 ms step
            return first, rate, second, waited, fresh, third, spent, again, fourth
        finally:
            await link.close()
            await server.stop(0.2)

    first, rate, second, waited, fresh, third, spent, again, fourth = asyncio.run(go())
    assert first.trees is not None and 1200 / 0.6 < rate < 1200 / 0.3
    assert second.trees is None and second.fallback is None and second.syncing == [0]
    assert waited < 0.15 and second.fresh
    assert fresh[0] == 0.0 and 0.25 < fresh[1] < 0.5         # a new prompt's, apart
    assert third.trees is None and third.catch_up and not third.fresh
    assert 0.25 < spent[0] < 0.5 and spent[1] == 0.0 and again == (0.0, 0.0)
    assert fourth.trees is None and fourth.syncing == [0] and fourth.catch_up
