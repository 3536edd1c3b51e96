"""The draft model's step as CUDA graphs hold it (batch bucket, page bucket, padding
rows on a scratch page, a catch-up chain padded to depth + 1 tokens, KV kept across
steps and moved into place on acceptance) proposes exactly what drafting each
sequence alone from scratch proposes."""

from __future__ import annotations

import random

import pytest
import torch

from treespec.common.spec.tree import envelope_from, validate_tree
from treespec.draft_service.config import DraftConfig
from treespec.draft_service.model_proposer import ModelProposer

PROMPTS = [[1, 5, 9, 13, 2, 7, 7, 30, 31], [3, 4, 5], [60]]   # 3 rows -> bucket of 4


def make(path, env):
    return ModelProposer.from_config(DraftConfig(
        method="model", model=str(path), envelope=env, device="cpu", kernels="reference",
        num_blocks=64, block_size=4))


def from_scratch(path, env, tokens: list[int]):
    """The tree a fresh proposer drafts for this token list alone."""
    p = make(path, env)
    p.update(0, tokens, len(tokens), [], None)
    t = p.propose([0])
    return t.tokens, t.parents


@pytest.mark.parametrize("name", ["chain4", "tree-small", "tree-wide"])
def test_bucketed_batch_equals_each_row_alone(draft_dir, name):
    env = envelope_from(name)
    bucketed = make(draft_dir, env)
    for s, toks in enumerate(PROMPTS):
        bucketed.update(s, toks, len(toks), [], None)
    got = bucketed.propose(list(range(len(PROMPTS))))
    for row, toks in enumerate(PROMPTS):
        t, p = from_scratch(draft_dir, env, toks)
        assert torch.equal(got.tokens[row:row + 1], t) and torch.equal(got.parents[row:row + 1], p)
    assert validate_tree(got.tokens, got.parents, env.num_nodes, 96) is None
    # 3 rows ran in the 4-bucket; the smaller buckets were made with it, so a batch
    # that shrinks later replays instead of capturing mid-serving
    assert bucketed.graphs.buckets.batches("step") == [1, 2, 4]


@pytest.mark.parametrize("name", ["chain4", "tree-small", "tree-wide"])
def test_steps_with_kept_kv_equal_drafting_from_scratch(draft_dir, name):
    """Steady state: each step's catch-up (accepted path + bonus, at most depth + 1
    tokens) runs with the expansion as one fixed-shape function over KV kept from
    earlier steps; over steps with random accepted paths it proposes exactly what a
    fresh proposer does for the same tokens."""
    env = envelope_from(name)
    fixed = make(draft_dir, env)
    rng = random.Random(5)
    seqs = {s: list(p) for s, p in enumerate(PROMPTS)}
    for s, toks in seqs.items():
        fixed.update(s, toks, len(toks), [], None)
    for step in range(5):
        order = list(seqs)
        rng.shuffle(order)
        got = fixed.propose(order)
        t1, p1 = got.tokens, got.parents
        for row, s in enumerate(order):
            t, p = from_scratch(draft_dir, env, seqs[s])
            assert torch.equal(t1[row:row + 1], t) and torch.equal(p1[row:row + 1], p), step
        assert validate_tree(t1, p1, env.num_nodes, 96) is None
        for row, s in enumerate(order):
            path, cur = [], -1
            while rng.random() < 0.7:
                kids = [i for i, q in enumerate(p1[row].tolist()) if q == cur]
                if not kids:
                    break
                cur = rng.choice(kids)
                path.append(cur)
            new = [int(t1[row, n]) for n in path] + [rng.randrange(96)]
            seqs[s].extend(new)
            fixed.update(s, seqs[s], len(new), path, None)


@pytest.mark.parametrize("name", ["chain4", "tree-small"])
def test_catch_up_padding_stays_in_reserved_pages(draft_dir, name):
    """A one-token catch-up pads depth tokens past the committed length; for every
    length (block size 4, so page edges fall everywhere) those slots are reserved,
    and the trees equal a fresh proposer's."""
    env = envelope_from(name)
    for n in range(3, 30):
        fixed = make(draft_dir, env)
        toks = [(7 * i + 3) % 96 for i in range(n)]
        for step in range(2):
            fixed.update(0, toks, len(toks) if step == 0 else 1, [], None)
            got = fixed.propose([0])
            t, p = from_scratch(draft_dir, env, toks)
            assert torch.equal(got.tokens, t) and torch.equal(got.parents, p), (n, step)
            toks = toks + [int(t[0, 0]) % 96 + 1 if int(t[0, 0]) + 1 < 96 else 0]
        assert fixed.graphs.buckets.batches("step") == [1]
