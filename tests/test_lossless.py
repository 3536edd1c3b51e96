"""Greedy speculative output equals transformers' greedy decode, token for token,
through real gRPC servers, for every proposer x envelope."""

from __future__ import annotations

import asyncio

import pytest

from treespec.common.client import AsyncTreespecClient
from inproc import greedy_reference, services

PROMPTS = [
    [1, 5, 9, 13, 2, 7, 1, 5, 9, 13, 2, 7, 1, 5],      # repeated spans: ngram food
    [3, 4, 5, 6],
    [10, 20, 30, 40, 50, 60, 70, 80, 10, 20, 30],
]
MAX_TOKENS = 24


async def _run(target, method, draft_model, envelope):
    async with services(target, method, draft_model, envelope) as h:
        async with AsyncTreespecClient(h["addr"]) as c:
            outs = [await c.generate(prompt_ids=p, max_tokens=MAX_TOKENS, ignore_eos=True)
                    for p in PROMPTS]
        free = h["engine"].kv_pages_used == 0
        return outs, free


@pytest.mark.parametrize("envelope", ["chain4", "tree-small"])
@pytest.mark.parametrize("proposer", ["ngram", "model-random", "model-self"])
def test_speculative_greedy_equals_plain_greedy(target_dir, draft_dir, proposer, envelope):
    method, draft_model = {"ngram": ("ngram", None), "model-random": ("model", draft_dir),
                           "model-self": ("model", target_dir)}[proposer]
    outs, all_free = asyncio.run(_run(target_dir, method, draft_model, envelope))
    for p, out in zip(PROMPTS, outs):
        assert out.token_ids == greedy_reference(target_dir, p, MAX_TOKENS)
        assert out.finish_reason == "length"
        s = out.stats
        assert s["completion_tokens"] == MAX_TOKENS
        assert s["accepted_tokens"] <= s["draft_tokens"]
        # every step commits accepted + 1 tokens (the prefill token is not a step)
        assert s["steps"] + s["accepted_tokens"] >= MAX_TOKENS - 1
    assert all_free
    if proposer == "model-self":
        # the draft is the target: nearly every draft token is accepted
        total = sum(o.stats["accepted_tokens"] for o in outs)
        steps = sum(o.stats["steps"] for o in outs)
        assert total / steps >= 3.0
    if proposer == "ngram":
        assert outs[0].stats["draft_tokens"] > 0


def test_plain_decode_without_draft(target_dir):
    outs, all_free = asyncio.run(_run(target_dir, None, None, "chain4"))
    for p, out in zip(PROMPTS, outs):
        assert out.token_ids == greedy_reference(target_dir, p, MAX_TOKENS)
        assert out.stats["fallback_steps"] == out.stats["steps"]
    assert all_free
