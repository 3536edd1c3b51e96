"""Every model proposer at serving load through the real CLI services, on their
defaults: 32 concurrent 1024-token prompts (what the H200 benchmark sends) on the
shipped tiny models. No step may go without speculation because of the engine's own
limits (a message over the frame limit, draft KV pages, a deadline, the draft going
busy), the only plain steps are EAGLE-3's and DFlash's while a prompt's hidden states
are still crossing to the draft, and every output equals plain decode (one plain run,
on the first of these verify services after its speculative load, serves every
proposer's comparison).

The n-gram proposer is not among them: on these random prompts its trees are empty
but for one-token matches (whose continuations the target never accepts; its case
could not even require a drafted token), so its load proved only what the draft
model's does through the same token updates and tree messages, at the cost of another
32k tokens of prefill on the CPU."""

from __future__ import annotations

import asyncio
import re

import pytest
import torch

import services
from treespec.common.client import AsyncTreespecClient
from prom import scrape

PROMPTS = [torch.randint(1, 6144, (1024,), generator=torch.Generator().manual_seed(i)).tolist()
           for i in range(32)]
MAX_TOKENS = 6
# what may leave a speculating step without a tree, by proposer
ALLOWED = {"model": set(), "eagle3": {"syncing"}, "dflash": {"syncing"}}
DRAFTS = {"model": "tiny-code-draft", "eagle3": "tiny-code-eagle3",
          "dflash": "tiny-code-dflash"}


async def _all(addr: str, plain: bool) -> list:
    async with AsyncTreespecClient(addr, timeout=600) as c:
        for _ in range(0 if plain else 300):      # the load starts on a connected draft
            if (await c.info()).draft_connected:
                break
            await asyncio.sleep(0.1)
        return await asyncio.gather(*[c.generate(prompt_ids=p, max_tokens=MAX_TOKENS,
                                                 ignore_eos=True, no_speculation=plain)
                                      for p in PROMPTS])


_plain: list[list[list[int]]] = []


def plain(addr: str) -> list[list[int]]:
    """Plain decode's outputs (no_speculation), from the first verify service a test of
    this module asks on, after its speculative load and its metrics: one run serves all."""
    if not _plain:
        _plain.append([o.token_ids for o in asyncio.run(_all(addr, plain=True))])
    return _plain[0]


@pytest.mark.parametrize("method", ["model", "eagle3", "dflash"])
def test_32_long_prompts_at_once(method):
    # CPU forwards over 32k tokens take seconds: the deadline is not what this tests
    extra = ("--target-embeddings", "tiny-code") if method in ("eagle3", "dflash") else ()
    with services.stack("tiny-code", method, DRAFTS[method], draft_args=extra,
                        verify_args=("--metrics-port", "0", "--step-deadline-ms", "120000",
                                     "--speculation", "always")
                        ) as (draft, verify):
        spec = asyncio.run(_all(verify.addr, plain=False))
        url = re.search(r"metrics on (http://\S+/metrics)", verify.output()).group(1)
        metrics = scrape(url)
        reasons = {dict(labels)["reason"]: v for (name, labels), v in metrics.items()
                   if name == "treespec:spec_decode_fallback_steps_total"}
        sent = sum(v for (name, _), v in metrics.items()
                   if name == "treespec:draft_hidden_state_bytes_total")
        log = draft.output() + verify.output()
        want = plain(verify.addr)
    assert [o.token_ids for o in spec] == want
    assert {r for r, v in reasons.items() if v} <= ALLOWED[method], (reasons, log)
    assert sum(o.stats["draft_tokens"] for o in spec) > 0
    assert "exceeds" not in log and "ran out" not in log, log
    if method in ("eagle3", "dflash"):  # each token's states once, through the draft's fc:
        # 256 float32 columns (the target's 3 layers are 768)
        assert ", projected" in log
        assert 32 * 1024 * 256 * 4 <= sent <= 32 * (1024 + MAX_TOKENS) * 256 * 4, sent
