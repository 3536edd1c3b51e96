"""The verify engine against drafters in the same process (no sockets, no gRPC): the
seam DraftLink implements. A drafter that proposes the target's own continuation is
accepted nearly whole and the output is plain greedy's; trees that break the rules
cost their step's speculation, never a token; every sequence that ends is released."""

from __future__ import annotations

import asyncio

import pytest
import torch

from treespec.common.model.qwen3 import Qwen3Model
from treespec.common.spec.messages import DrafterInfo
from treespec.common.spec.tree import PAD, PRESETS, TreeBatch
from inproc import greedy_reference
from treespec.verify_service.drafter import Drafted
from treespec.verify_service.engine import VerifyEngine
from treespec.verify_service.request import GenRequest

ENV = PRESETS["chain4"]
PROMPTS = [[1, 5, 9, 13, 2, 7, 1, 5], [3, 4, 5, 6], [10, 20, 30, 40, 50, 60, 70]]
MAX_TOKENS = 20


class ContinuationDrafter:
    """Drafts each sequence's known greedy continuation as a chain; `break_with` makes
    every tree broken in one way."""

    def __init__(self, refs: dict[tuple[int, ...], list[int]], break_with: str = "") -> None:
        self.refs, self.break_with = refs, break_with
        self.info = DrafterInfo(ENV, vocab_size=96, proposer="continuation")
        self.ready = True
        self.released: list[int] = []
        self.steps = 0

    async def propose(self, seqs, trace, depth=0, step_s=None) -> Drafted:
        self.steps += 1
        rows = []
        for s in seqs:
            prompt = tuple(s.req.prompt_ids)
            done = len(s.tokens) - len(prompt)
            chain = self.refs[prompt][done:done + ENV.depth]
            rows.append(chain + [0] * (ENV.depth - len(chain)))
        tokens = torch.tensor(rows, dtype=torch.int32)
        parents = torch.arange(-1, ENV.depth - 1, dtype=torch.int32).repeat(len(seqs), 1)
        if self.break_with == "parents":
            parents[:, 0] = 3                       # a parent after its child
        elif self.break_with == "vocab":
            tokens[:, 0] = 96
        elif self.break_with == "empty":
            tokens[:], parents[:] = 0, PAD
        elif self.break_with == "rows":
            tokens, parents = tokens[:-1], parents[:-1]
        return Drafted(TreeBatch(tokens, parents), step_id=self.steps)

    def release(self, seq_ids):
        self.released += seq_ids

    def take_unwaited(self):
        return 0.0, 0.0

    async def idle(self):
        pass


async def _serve(target_dir, drafter, speculation="adaptive"
                 ) -> tuple[list[list[int]], VerifyEngine, list[int], list[int]]:
    engine = VerifyEngine(Qwen3Model.from_pretrained(target_dir), num_blocks=256, block_size=4,
                          max_batch=4, max_model_len=0, prefill_tokens=4096, link=drafter,
                          speculation=speculation)
    engine.start()
    try:
        seqs = [engine.submit(GenRequest(tuple(p), MAX_TOKENS, ignore_eos=True))
                for p in PROMPTS]
        outs = []
        for seq in seqs:
            ids: list[int] = []
            while True:
                o = await seq.out.get()
                ids += o.token_ids
                if o.finish_reason:
                    break
            outs.append(ids)
        steps = [s.stats.steps for s in seqs]
        for _ in range(100):                  # the engine reaps finished sequences
            if not engine.running:
                break
            await asyncio.sleep(0.01)
        return outs, engine, [s.seq_id for s in seqs], steps
    finally:
        await engine.stop()


def test_the_targets_own_continuation_is_accepted_and_exact(target_dir):
    refs = {tuple(p): greedy_reference(target_dir, p, MAX_TOKENS) for p in PROMPTS}
    drafter = ContinuationDrafter(refs)
    outs, engine, ids, steps = asyncio.run(_serve(target_dir, drafter))
    assert outs == [refs[tuple(p)] for p in PROMPTS]
    # every step commits a chain of 4 and its bonus: 19 tokens after prefill in 4 steps
    assert steps == [4, 4, 4] and not engine.fallbacks
    # the first step of a budget captured every budget's graph (the controller may try
    # depth 2 or 1 later without a capture stalling a step)
    assert {1, 2, 4} <= {k[0][0] for k in engine.verifier.buckets.graphs}
    assert sorted(drafter.released) == sorted(ids) and engine.kv_pages_used == 0


@pytest.mark.parametrize("break_with", ["parents", "vocab", "rows"])
def test_a_broken_tree_costs_speculation_never_a_token(target_dir, break_with):
    refs = {tuple(p): greedy_reference(target_dir, p, MAX_TOKENS) for p in PROMPTS}
    drafter = ContinuationDrafter(refs, break_with)
    outs, engine, _, steps = asyncio.run(_serve(target_dir, drafter))
    assert outs == [refs[tuple(p)] for p in PROMPTS]
    assert steps == [MAX_TOKENS - 1] * 3                 # every step ran as plain decode
    assert engine.kv_pages_used == 0
    # a broken tree is a try that accepted nothing: asked until each sequence rests, as
    # for empty trees below, not on every step
    assert set(engine.fallbacks) == {"invalid_proposal", "off_by_controller"}
    assert 2 <= drafter.steps <= 5, drafter.steps


@pytest.mark.parametrize("speculation", ["always", "adaptive"])
def test_a_step_of_empty_trees_runs_the_plain_decode_graph(target_dir, speculation):
    """Nothing to verify, nothing paid: trees of padding only run the plain step; and
    when they keep coming, the controller stops asking (no hop) but now and then."""
    refs = {tuple(p): greedy_reference(target_dir, p, MAX_TOKENS) for p in PROMPTS}
    drafter = ContinuationDrafter(refs, "empty")
    outs, engine, _, steps = asyncio.run(_serve(target_dir, drafter, speculation))
    assert outs == [refs[tuple(p)] for p in PROMPTS]
    assert steps == [MAX_TOKENS - 1] * 3
    assert {k[0][0] for k in engine.verifier.buckets.graphs} == {0}    # tree size 0 only
    if speculation == "always":
        assert set(engine.fallbacks) == {"empty_tree"} and drafter.steps == MAX_TOKENS - 1
    else:   # asked until each sequence rests (a few steps), then once after 8 steps
        assert set(engine.fallbacks) == {"empty_tree", "off_by_controller"}
        assert 2 <= drafter.steps <= 5
