"""Drafters that sample with the request's own noise (coupled drafting).

A model drafter picks a sampling row's children by log-prob plus the Gumbel noise the
target draws with at that position (treespec.common.spec.sampling.draft_scores), so its first
child is the target's very draw wherever the two distributions agree: a drafter that
*is* the target has every chain node accepted at any temperature, while top-k
drafting (--draft-sampling deterministic) misses whenever the draw is not the argmax.
Either way coupled acceptance gives the same tokens.
"""

from __future__ import annotations

import asyncio

import torch

from treespec.common.client import AsyncTreespecClient
from treespec.common.spec.sampling import TOPK_FIRST, draft_scores, draw
from inproc import services
from test_dflash import dflash_small  # noqa: F401  (fixture)
from test_eagle3 import head_dir  # noqa: F401  (fixture)
from treespec.kernels.noise import gumbel_noise

PROMPT = [5, 17, 40, 2, 66, 9]
SEEDS = range(20, 28)
TOKENS = 24


def spread(x: torch.Tensor, cols: torch.Tensor, v: int) -> torch.Tensor:
    """draft_scores' [R, W] values over the vocabulary [R, v], -inf off their columns."""
    return torch.full((x.shape[0], v), float("-inf")).scatter(-1, cols, x)


def test_the_first_pick_is_the_targets_draw_and_ids_key_the_noise():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 40, generator=g) * 2
    rows = [torch.tensor([1.0, 0.7, 1.3, 0.0, 1.0, 0.5]), torch.tensor([0, 5, 0, 0, 3, 0]),
            torch.tensor([1.0, 1.0, 0.8, 1.0, 1.0, 0.9]), torch.tensor([0, 0, 0.05, 0, 0, 0]),
            torch.arange(6) * 11, torch.arange(6) + 30]
    coupled = torch.zeros(6, dtype=torch.bool)
    lp, pick, cols, _, q_probs = draft_scores(logits, *rows, coupled)
    lp, pick = spread(lp, cols, 40), spread(pick, cols, 40)
    assert torch.equal(pick.argmax(-1), draw(logits, *rows))
    assert torch.equal(lp[3], logits[3].log_softmax(-1))            # T 0: plain log-probs
    assert torch.equal(pick[3], lp[3])
    assert not q_probs.any()
    # rejection rows draw from q, the 8 likeliest of their filtered distribution
    lp, pick, cols, q_ids, q_probs = draft_scores(logits, *rows, ~coupled)
    pick = spread(pick, cols, 40)
    assert torch.allclose(q_probs[[0, 1, 2, 4, 5]].sum(-1), torch.ones(5))
    assert not q_probs[3].any()                                     # T 0: no q
    for r in (0, 1, 2, 4, 5):
        inside = torch.zeros(40, dtype=torch.bool)
        inside[q_ids[r][q_probs[r] > 0].long()] = True
        assert torch.isinf(pick[r][~inside]).all() and pick[r].argmax() in q_ids[r]
    sub = torch.tensor([3, 9, 33])              # a drafter's columns are target ids 3, 9, 33
    _, sub_pick, sub_cols, _, _ = draft_scores(logits[:, sub], *rows, coupled, ids=sub)
    noise = gumbel_noise(rows[4], rows[5], 40)[:, sub]
    kept = spread(sub_pick, sub_cols, 3)[0] - noise[0]
    assert torch.allclose(kept - kept.logsumexp(0), logits[0, sub].log_softmax(0), atol=1e-5)


def test_top_k_first_drafting_scores_as_the_whole_vocabulary():
    """With every drawing row's top_k <= the width the drafter scores W candidates
    and their noise only: the same log-probs, picks and q as over the vocabulary."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 300, generator=g) * 2
    rows = [torch.tensor([1.0, 0.7, 0.0, 1.3, 0.6, 1.0, 0.9, 0.0]),
            torch.tensor([5, 12, 0, 20, 1, 3, 20, 0]), torch.rand(8, generator=g) * 0.5 + 0.5,
            torch.rand(8, generator=g) * 0.1, torch.arange(8) * 7, torch.arange(8) + 40]
    sampled = rows[0] > 0
    for rej in (torch.zeros(8, dtype=torch.bool), torch.arange(8) % 2 == 0):
        for ids in (None, torch.randperm(1000, generator=g)[:300]):
            dense = draft_scores(logits, *rows, rej, ids=ids)
            sparse = draft_scores(logits, *rows, rej, ids=ids, width=TOPK_FIRST)
            assert dense[0].shape == (8, 300) and sparse[0].shape == (8, TOPK_FIRST)
            for x, y in zip(dense[:2], sparse[:2]):
                x = spread(x, dense[2], 300)
                torch.testing.assert_close(x.gather(-1, sparse[2]), y, atol=1e-5, rtol=1e-5)
                off = torch.ones(8, 300, dtype=torch.bool).scatter(-1, sparse[2], False)
                assert torch.isinf(x[sampled.unsqueeze(-1) & off]).all()  # filtered out
            torch.testing.assert_close(dense[4], sparse[4])
            live = dense[4] > 0                     # a zero-probability q entry's id is moot
            assert torch.equal(dense[3][live], sparse[3][live])


async def _run(target_dir, draft_sampling: str) -> tuple[list[list[int]], float]:
    async with services(target_dir, "model", target_dir, "chain4", acceptance="coupled",
                        draft_kw=dict(draft_sampling=draft_sampling)) as h:
        async with AsyncTreespecClient(h["addr"]) as c:
            outs = await asyncio.gather(*[
                c.generate(prompt_ids=PROMPT, max_tokens=TOKENS, ignore_eos=True, seed=s,
                           temperature=1.0) for s in SEEDS])
    steps = sum(o.stats["steps"] for o in outs)
    assert all(o.stats["fallback_steps"] == 0 for o in outs)
    return [o.token_ids for o in outs], sum(len(o.token_ids) - 1 for o in outs) / steps


def test_the_target_as_its_own_coupled_drafter_has_every_node_accepted(target_dir):
    coupled, per_step = asyncio.run(_run(target_dir, "sample"))
    top_k, top_k_per_step = asyncio.run(_run(target_dir, "deterministic"))
    assert coupled == top_k                      # coupled acceptance: the drafter never matters
    assert len({tuple(t) for t in coupled}) == len(SEEDS)           # and the seeds do
    assert per_step >= 4.5, per_step             # chain4: 5 tokens a step at most
    assert top_k_per_step < per_step - 1, (top_k_per_step, per_step)


MIXED = [dict(temperature=0.8, top_k=20, seed=3), dict(), dict(temperature=1.0, seed=4),
         dict(temperature=0.6, top_p=0.9, min_p=0.05, seed=5)]


async def _mixed(target_dir, method, draft) -> tuple[list[list[int]], int]:
    kw = {"target_embeddings": str(target_dir)} if method == "dflash" else {}
    async with services(target_dir, method, draft, "tree-small", acceptance="coupled",
                        draft_kw=kw) as h:
        async with AsyncTreespecClient(h["addr"]) as c:
            outs = await asyncio.gather(*[
                c.generate(prompt_ids=PROMPT, max_tokens=TOKENS, ignore_eos=True, **kw)
                for kw in MIXED])
        assert h["engine"].kv_pages_used == 0
    return [o.token_ids for o in outs], sum(o.stats["accepted_tokens"] for o in outs)


def test_a_mixed_batch_gives_the_same_tokens_with_every_drafter(target_dir, draft_dir,
                                                                head_dir, dflash_small):
    """Greedy and sampling rows in one batch, each drafter drafting the sampling rows
    with their noise: the tokens are those of plain decode with the same seeds."""
    plain, _ = asyncio.run(_mixed(target_dir, None, None))
    for method, draft in (("ngram", None), ("model", draft_dir), ("eagle3", head_dir),
                          ("dflash", dflash_small)):
        got, accepted = asyncio.run(_mixed(target_dir, method, draft))
        assert got == plain, method
        assert method == "ngram" or accepted > 0, method
