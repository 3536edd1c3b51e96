"""The EAGLE-3 proposer's start-up warm-up and its fixed-shape step (what a GPU
replays as one CUDA graph: padded catch-up, page buckets, KV kept across steps),
against drafting from scratch, on the CPU."""

from __future__ import annotations

import random

import pytest
import torch

from treespec.common.spec.tree import PRESETS, ROOT
from test_eagle3 import C, _inputs, _proposer, head_dir  # noqa: F401  (head_dir: fixture)
from tests_data import tp


@pytest.mark.parametrize("lookahead", [False, True])
def test_warm_up_leaves_no_state_and_proposals_unchanged(head_dir, lookahead):
    """The GPU start-up warm-up (here eagerly, zero features; with a lookahead's guesses
    too) returns every page, keeps no sequence, and later proposals equal a fresh
    proposer's."""
    env = PRESETS["tree-small"]
    warm, cold = _proposer(head_dir, env), _proposer(head_dir, env)
    free = warm.cache.blocks.num_free
    assert warm.warm_up(lengths=(3, 20), batch=3, lookahead=lookahead) >= 0
    assert not warm._seqs and warm.cache.blocks.num_free == free
    tokens, rows = _inputs(4, 9)
    for p in (warm, cold):
        p.update(1, tokens, len(tokens), [], rows)
    (tw, pw), (tc, pc) = tp(warm.propose([1])), tp(cold.propose([1]))
    assert torch.equal(tw, tc) and torch.equal(pw, pc)


@pytest.mark.parametrize("name", ["chain4", "tree-small", "tree-wide"])
def test_fixed_shape_step_equals_drafting_from_scratch(head_dir, name):
    """The step a GPU replays (catch-up padded to depth + 1 pairs over KV kept from
    earlier steps, then the expansion, eagle3_step) proposes exactly what a fresh
    proposer given the same pairs does, over steps with random accepted paths and
    over lengths that put the padding on page edges."""
    env = PRESETS[name]
    rng = random.Random(11)
    g = torch.Generator().manual_seed(12)
    for n in (3, 6, 7, 8, 13):
        fixed = _proposer(head_dir, env)
        tokens, rows = _inputs(n, n)
        fixed.update(0, tokens, len(tokens), [], rows)
        for step in range(4):
            fresh = _proposer(head_dir, env)
            fresh.update(0, tokens, len(tokens), [], rows)
            (t1, p1), (t2, p2) = tp(fresh.propose([0])), tp(fixed.propose([0]))
            assert torch.equal(t1, t2) and torch.equal(p1, p2), (n, step)
            path, cur = [], ROOT
            while rng.random() < 0.6:
                kids = [i for i, q in enumerate(p1[0].tolist()) if q == cur]
                if not kids:
                    break
                cur = rng.choice(kids)
                path.append(cur)
            new = [int(t1[0, i]) for i in path] + [rng.randrange(96)]
            tokens = tokens + new
            feats = torch.randn(len(new), C, generator=g)
            rows = torch.cat([rows, feats])
            fixed.update(0, tokens, len(new), path, feats)
        assert fixed.graphs.buckets.batches("step") == [1]


@pytest.mark.parametrize("slow_call", [1, 2, 3])
def test_late_drafter_keeps_hidden_rows_aligned(target_dir, head_dir, slow_call):
    """A drafter that misses the step deadline turns steps into plain decode; those
    steps must still capture the root's hidden row, or the next update carries too
    few rows and the drafter refuses the stream. Output stays greedy's, and the
    only fallbacks are the deadline's own."""
    import asyncio
    import time

    from treespec.common.client import AsyncTreespecClient
    from inproc import greedy_reference, services
    from test_eagle3 import MAX_TOKENS, PROMPTS

    async def go():
        async with services(target_dir, "eagle3", head_dir, "tree-small",
                            step_deadline_ms=30) as h:
            prop = h["draft_engine"].proposer
            propose, calls = prop.propose, [0]

            def late(ids, sampling=None):
                calls[0] += 1
                if calls[0] in (slow_call, slow_call + 3):
                    time.sleep(0.1)
                return propose(ids, sampling)
            prop.propose = late
            async with AsyncTreespecClient(h["addr"]) as c:
                outs = [await c.generate(prompt_ids=p, max_tokens=MAX_TOKENS, ignore_eos=True)
                        for p in PROMPTS]
            return outs, dict(h["engine"].fallbacks)
    outs, fallbacks = asyncio.run(go())
    for p, out in zip(PROMPTS, outs):
        assert out.token_ids == greedy_reference(target_dir, p, MAX_TOKENS)
    assert "deadline" in fallbacks
    assert set(fallbacks) <= {"deadline", "busy"}, fallbacks


def test_a_shallower_budget_expands_fewer_levels(head_dir):
    """Asked for depth 2 of tree-small (the verify's budget), the head expands one
    level after the catch-up: exactly the nodes a depth-2 tree of the envelope holds,
    none deeper; the whole envelope again afterwards."""
    from treespec.common.spec.tree import PAD, budget_nodes, node_depths
    env = PRESETS["tree-small"]
    p = _proposer(head_dir, env)
    tokens, rows = _inputs(4, 9)
    p.update(1, tokens, len(tokens), [], rows)
    t, par = tp(p.propose([1], depth=2))
    live = par[0] != PAD
    assert int(live.sum()) == budget_nodes(env, 2) and t.shape[1] == env.num_nodes
    assert int(node_depths(par).max()) <= 2
    assert tp(p.propose([1]))[1][0].ne(PAD).all()
