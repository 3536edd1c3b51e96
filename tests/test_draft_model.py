"""The model proposer: greedy chains, EAGLE-2 trees, KV rollback, page accounting."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen3ForCausalLM

from treespec.common.spec.tree import (PAD, TreeEnvelope, budget_nodes, envelope_from, node_depths,
                         validate_tree)
from treespec.draft_service.config import DraftConfig
from treespec.draft_service.model_proposer import ModelProposer

from treespec.draft_service.tree_build import Expansion
from treespec.kernels import reference
from treespec.kernels.dispatch import KERNEL_NAMES
from tests_data import tp

VOCAB = 96
PROMPTS = [[1, 5, 9, 13, 2, 7, 7, 30, 31], [3, 4, 5], [60]]


def make(path, env: TreeEnvelope, num_blocks: int = 64, block_size: int = 4) -> ModelProposer:
    return ModelProposer.from_config(DraftConfig(
        method="model", model=str(path), envelope=env, device="cpu", kernels="reference",
        num_blocks=num_blocks, block_size=block_size))


def hf_next_logp(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)


def path_of(tokens: list[int], parents: list[int], i: int) -> list[int]:
    out = []
    while i >= 0:
        out.append(tokens[i])
        i = parents[i]
    return out[::-1]


@pytest.mark.parametrize("which", ["draft_dir", "target_dir"])
def test_chain_is_the_draft_models_greedy_continuation(which, request):
    path = request.getfixturevalue(which)
    hf = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prop = make(path, envelope_from("chain4"))
    for s, p in enumerate(PROMPTS):
        prop.update(s, p, len(p), [], None)
    _tb = prop.propose(list(range(len(PROMPTS))))
    tokens, parents = _tb.tokens, _tb.parents
    for s, p in enumerate(PROMPTS):
        ids = list(p)
        for _ in range(4):
            ids.append(int(hf_next_logp(hf, ids).argmax()))
        assert tokens[s].tolist() == ids[len(p):], f"seq {s}"
        assert parents[s].tolist() == [-1, 0, 1, 2]


def test_tree_level1_is_topk_and_rerank_is_best_first(draft_dir):
    hf = Qwen3ForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    for name in ("tree-small", "tree-wide"):
        env = envelope_from(name)
        prop = make(draft_dir, env)
        for s, p in enumerate(PROMPTS):
            prop.update(s, p, len(p), [], None)
        _tb = prop.propose(list(range(len(PROMPTS))))
        tokens, parents = _tb.tokens, _tb.parents
        assert validate_tree(tokens, parents, env.num_nodes, VOCAB) is None
        assert int(node_depths(parents).max()) <= env.depth
        for s, p in enumerate(PROMPTS):
            t, par = tokens[s].tolist(), parents[s].tolist()
            assert PAD not in par                      # a model always fills the tree
            level1 = {x for x, q in zip(t, par) if q == -1}
            assert level1 == set(hf_next_logp(hf, p).topk(env.topk).indices.tolist())
            # cumulative draft log-prob of every node's path, recomputed by HF
            score = []
            for i in range(env.num_nodes):
                ids, lp = list(p), 0.0
                for x in path_of(t, par, i):
                    lp += float(hf_next_logp(hf, ids)[x])
                    ids.append(x)
                score.append(lp)
            assert all(a >= b - 1e-4 for a, b in zip(score, score[1:])), "not best first"
            for i, q in enumerate(par):
                assert q < i and (q == -1 or score[q] >= score[i] - 1e-5)


def test_expansion_docstring_example():
    a, b, c, d, e, f = 10, 11, 12, 13, 14, 15
    root = torch.full((1, 20), -9.0)
    root[0, a], root[0, b] = -0.1, -1.0
    exp = Expansion(root, topk=2, depth=2)
    tok, cpar, depths = exp.chunk(1)
    assert tok.tolist() == [[a, b]] and cpar.tolist() == [[-1, -1]] and depths == [0, 0]
    logp = torch.full((1, 2, 20), -9.0)
    logp[0, 0, c], logp[0, 0, d] = -0.2, -2.0
    logp[0, 1, e], logp[0, 1, f] = -0.2, -2.0
    exp.grow(1, logp)
    t, p, chunk = exp.rerank(3)
    assert t.tolist() == [[a, c, b]] and p.tolist() == [[-1, 0, -1]]
    assert chunk.tolist() == [[0, -1, 1]]


def test_rerank_ties_keep_parents_first():
    # every log-prob 0: all scores tie, so order falls back to candidate id = depth
    exp = Expansion(torch.zeros(1, 8), topk=2, depth=3)
    for level in (1, 2):
        exp.grow(level, torch.zeros(1, 2, 8))
    t, p, _ = exp.rerank(10)
    assert validate_tree(t, p, 10, 8) is None
    assert node_depths(p)[0].tolist() == sorted(node_depths(p)[0].tolist())


def random_walk(rng: random.Random, tokens: list[int], parents: list[int]) -> list[int]:
    """A random accepted path: from the root, descend to a random child, stop at random."""
    path, cur = [], -1
    while True:
        kids = [i for i, q in enumerate(parents) if q == cur]
        if not kids or rng.random() < 0.2:
            return path
        cur = rng.choice(kids)
        path.append(cur)


@pytest.mark.parametrize("name, shallow", [("chain4", False), ("tree-small", False),
                                           ("tree-wide", False), ("chain4", True),
                                           ("tree-small", True)])
def test_compacted_kv_proposes_exactly_what_a_recompute_does(draft_dir, name, shallow):
    """shallow: steps asked for trees of depth 2 and 1 between whole ones (the verify's
    budget): only that many levels are expanded, and the KV kept after them is right."""
    env = envelope_from(name)
    moves = []

    def counting_compact(k, v, src, dst):
        moves.append(int((src != dst).sum()))
        reference.compact_kv(k, v, src, dst)

    inc = make(draft_dir, env, num_blocks=128)
    inc.ops = SimpleNamespace(**{n: getattr(reference, n) for n in KERNEL_NAMES
                                 if n != "compact_kv"}, compact_kv=counting_compact)
    fresh = make(draft_dir, env, num_blocks=128)
    rng = random.Random(3)
    seqs = {s: list(p) for s, p in enumerate(PROMPTS)}
    for s, p in seqs.items():
        inc.update(s, p, len(p), [], None)
    kept = 0
    for step in range(6):
        order = list(seqs)
        rng.shuffle(order)
        depth = (0, 2, 1)[step % 3] if shallow else 0
        _tb = inc.propose(order, depth=depth)
        t, p = _tb.tokens, _tb.parents
        for s in order:
            fresh.release(s)
            fresh.update(s, seqs[s], len(seqs[s]), [], None)
        _tb = fresh.propose(order, depth=depth)
        t2, p2 = _tb.tokens, _tb.parents
        assert torch.equal(t, t2) and torch.equal(p, p2), f"step {step}"
        if depth:
            deep = [len(path_of(t[r].tolist(), p[r].tolist(), i)) for r in range(len(order))
                    for i in range(env.num_nodes) if p[r, i] != PAD]
            assert max(deep) <= depth and len(deep) == len(order) * budget_nodes(env, depth)
        for row, s in enumerate(order):
            path = random_walk(rng, t[row].tolist(), p[row].tolist())
            new = [int(t[row, n]) for n in path] + [rng.randrange(VOCAB)]
            seqs[s].extend(new)
            before = inc._seqs[s].pages.kv_len
            inc.update(s, seqs[s], len(new), path, None)
            kept += inc._seqs[s].pages.kv_len - before
    assert kept > 0, "no accepted KV was ever kept"
    if env.topk > 1:
        assert sum(moves) > 0, "no KV was ever moved"


def test_inconsistent_accepted_nodes_are_recomputed(draft_dir):
    env = envelope_from("tree-small")
    inc, fresh = make(draft_dir, env), make(draft_dir, env)
    p = list(PROMPTS[0])
    inc.update(0, p, len(p), [], None)
    _tb = inc.propose([0])
    t, par = _tb.tokens, _tb.parents
    wrong = [int(t[0, 0]) + 1 if int(t[0, 0]) + 1 < VOCAB else 0, 5]   # not what node 0 says
    p += wrong
    inc.update(0, p, 2, [0], None)                    # claims node 0 was accepted
    assert inc._seqs[0].pages.kv_len == len(PROMPTS[0])
    fresh.update(0, p, len(p), [], None)
    a, b = tp(inc.propose([0])), tp(fresh.propose([0]))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_release_frees_every_page(draft_dir):
    prop = make(draft_dir, envelope_from("tree-wide"), num_blocks=64)
    start = prop.cache.blocks.num_free
    for s, p in enumerate(PROMPTS):
        prop.update(s, p, len(p), [], None)
    prop.propose([0, 1, 2])
    assert prop.cache.blocks.num_free < start
    for s in range(3):
        prop.release(s)
    prop.release(1)
    assert prop.cache.blocks.num_free == start


def test_out_of_pages_drops_idle_kv_then_pads(draft_dir):
    env = envelope_from("chain4")        # scratch 4 slots (a padded catch-up); block 4
    prop = make(draft_dir, env, num_blocks=7, block_size=4)   # 6 + the graphs' scratch page
    long = list(range(1, 13))            # 12 + 4 = 16 slots = 4 pages
    prop.update(0, long, len(long), [], None)
    prop.update(1, [2, 3], 2, [], None)  # 2 + 4 = 6 slots = 2 pages
    _tb = prop.propose([0, 1])
    t, _ = _tb.tokens, _tb.parents
    assert prop.cache.blocks.num_free == 0
    prop.update(2, [4, 5, 6], 3, [], None)
    _tb = prop.propose([2])             # needs 2 pages: seq 0 (least recent) loses its KV
    t, p = _tb.tokens, _tb.parents
    assert (p[0] != PAD).all()
    assert not prop._seqs[0].pages.pages and prop._seqs[1].pages.pages
    huge = list(range(1, 40))
    prop.update(3, huge, len(huge), [], None)
    _tb = prop.propose([3, 2])          # seq 3 can never fit: padding, seq 2 still drafts
    t, p = _tb.tokens, _tb.parents
    assert (p[0] == PAD).all() and (p[1] != PAD).all()
    _tb = prop.propose([0])             # seq 0 recomputes from its tokens
    t, p = _tb.tokens, _tb.parents
    assert (p[0] != PAD).all()


def test_warmup_leaves_no_state_and_proposals_unchanged(draft_dir):
    """The GPU start-up warm-up (run here eagerly) returns every page, keeps no
    sequence, and what is proposed afterwards equals a fresh proposer's."""
    env = envelope_from("tree-small")
    warm, cold = make(draft_dir, env, num_blocks=128), make(draft_dir, env, num_blocks=128)
    free = warm.cache.blocks.num_free
    assert warm.warm_up(lengths=(3, 37), batch=3) >= 0
    assert not warm._seqs and warm.cache.blocks.num_free == free
    prompt = [5, 9, 2, 7, 7, 1, 3]
    for p in (warm, cold):
        p.update(1, prompt, len(prompt), [], None)
    (tw, pw), (tc, pc) = tp(warm.propose([1])), tp(cold.propose([1]))
    assert torch.equal(tw, tc) and torch.equal(pw, pc)


def test_long_catch_ups_run_in_bounded_parts_and_draft_the_same(draft_dir, monkeypatch):
    """A prompt's catch-up cut into forwards of 5 units drafts what one forward does."""
    from treespec.draft_service import kv_drafter
    long = [(7 * i) % 90 + 1 for i in range(40)]

    def trees():
        prop = make(draft_dir, envelope_from("tree-small"))
        for s, p in enumerate([long, PROMPTS[0], long[:17]]):
            prop.update(s, p, len(p), [], None)
        t = prop.propose([0, 1, 2])
        return t.tokens.tolist(), t.parents.tolist()
    whole = trees()
    monkeypatch.setattr(kv_drafter, "PREFILL_UNITS", 5)
    assert trees() == whole
    parts = kv_drafter.prefill_parts([("a", 0, 7), ("b", 3, 5), ("c", 0, 9)], 5)
    assert parts == [[("a", 0, 5)], [("a", 5, 7), ("b", 3, 5), ("c", 0, 1)],
                     [("c", 1, 6)], [("c", 6, 9)]]
