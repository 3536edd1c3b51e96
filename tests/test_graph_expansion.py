"""The draft's expansion as CUDA graphs hold it (batch bucket, page bucket, padding
rows on a scratch page) proposes exactly what the direct path proposes."""

from __future__ import annotations

import pytest
import torch

from common.tree import envelope_from, validate_tree
from draft_service.config import DraftConfig
from draft_service.graph_expansion import GraphExpander
from draft_service.model_proposer import ModelProposer

PROMPTS = [[1, 5, 9, 13, 2, 7, 7, 30, 31], [3, 4, 5], [60]]   # 3 rows -> bucket of 4


def make(path, env):
    return ModelProposer.from_config(DraftConfig(
        method="model", model=str(path), envelope=env, device="cpu", kernels="reference",
        num_blocks=64, block_size=4))


@pytest.mark.parametrize("name", ["chain4", "tree-small", "tree-wide"])
def test_bucketed_expansion_equals_direct(draft_dir, name):
    env = envelope_from(name)
    direct, bucketed = make(draft_dir, env), make(draft_dir, env)
    bucketed.expander = GraphExpander(bucketed.net, bucketed.cache, bucketed.ops, env,
                                      capture=False)
    trees = []
    for p in (direct, bucketed):
        for s, toks in enumerate(PROMPTS):
            p.update(s, toks, len(toks), [], None)
        trees.append(p.propose(list(range(len(PROMPTS)))))
    (t1, p1), (t2, p2) = trees
    assert torch.equal(t1, t2) and torch.equal(p1, p2)
    assert validate_tree(t1, p1, env.num_nodes, 96) is None
    # 3 rows ran in the 4-bucket; the smaller buckets were made with it, so a batch
    # that shrinks later replays instead of capturing mid-serving
    assert bucketed.expander.buckets.batches("expand") == [1, 2, 4]


@pytest.mark.parametrize("name", ["chain4", "tree-small", "tree-wide"])
def test_fixed_catch_up_steps_equal_direct(draft_dir, name):
    """Steady state: each step's catch-up (accepted path + bonus, at most depth + 1
    tokens) runs with the expansion as one fixed-shape function; over steps with
    random accepted paths it proposes exactly what the direct path does."""
    import random
    env = envelope_from(name)
    direct, fixed = make(draft_dir, env), make(draft_dir, env)
    fixed.expander = GraphExpander(fixed.net, fixed.cache, fixed.ops, env, capture=False)
    rng = random.Random(5)
    seqs = {s: list(p) for s, p in enumerate(PROMPTS)}
    for prop in (direct, fixed):
        for s, toks in seqs.items():
            prop.update(s, toks, len(toks), [], None)
    for step in range(5):
        order = list(seqs)
        rng.shuffle(order)
        (t1, p1), (t2, p2) = direct.propose(order), fixed.propose(order)
        assert torch.equal(t1, t2) and torch.equal(p1, p2), f"step {step}"
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
            for prop in (direct, fixed):
                prop.update(s, seqs[s], len(new), path, None)
    assert fixed.expander.buckets.batches("step") == [1, 2, 4], "the fixed catch-up never ran"


@pytest.mark.parametrize("name", ["chain4", "tree-small"])
def test_fixed_catch_up_padding_stays_in_reserved_pages(draft_dir, name):
    """A one-token catch-up pads depth tokens past the committed length; for every
    length (block size 4, so page edges fall everywhere) those slots are reserved,
    and the trees equal the direct path's."""
    env = envelope_from(name)
    for n in range(3, 30):
        direct, fixed = make(draft_dir, env), make(draft_dir, env)
        fixed.expander = GraphExpander(fixed.net, fixed.cache, fixed.ops, env, capture=False)
        toks = [(7 * i + 3) % 96 for i in range(n)]
        for step in range(2):
            for prop in (direct, fixed):
                prop.update(0, toks, len(toks) if step == 0 else 1, [], None)
            (t1, p1), (t2, p2) = direct.propose([0]), fixed.propose([0])
            assert torch.equal(t1, t2) and torch.equal(p1, p2), (n, step)
            toks = toks + [int(t1[0, 0]) % 96 + 1 if int(t1[0, 0]) + 1 < 96 else 0]
        assert fixed.expander.buckets.batches("step") == [1]
