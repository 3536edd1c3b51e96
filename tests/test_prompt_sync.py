"""Long prompts at batch reach a feature drafter (EAGLE-3) as fast as the prefill makes
their hidden states: rows run plain for `syncing` about one step each (the last prefill
chunk's rows cross while that step runs), not for as many steps as the step's byte bound
takes to carry every prompt, and the output is plain decode's.

The shipped tiny pair, both services in process. The step's bound is set to 16 rows
against prefill chunks of 64 tokens: the ratio of the 8 MB bound (1,024 rows of 8 KB) to
4,096-token chunks on a GPU, where 48 prompts of 2,048 tokens spent ~100 steps syncing."""

from __future__ import annotations

import asyncio

import torch

from inproc import services
from treespec.common.client import AsyncTreespecClient
from treespec.common.model.paths import SHIPPED_DIR

TARGET, HEAD = SHIPPED_DIR / "tiny-code", SHIPPED_DIR / "tiny-code-eagle3"
PROMPTS = [torch.randint(1, 6144, (384,), generator=torch.Generator().manual_seed(i)).tolist()
           for i in range(6)]
MAX_TOKENS = 16
STEP_ROWS, PREFILL_TOKENS = 16, 64


def test_long_prompts_at_batch_sync_as_fast_as_they_prefill():
    async def go():
        async with services(TARGET, "eagle3", HEAD, draft_kw={"target_embeddings": str(TARGET)},
                            prefill_tokens=PREFILL_TOKENS, max_batch=len(PROMPTS),
                            num_blocks=1024) as h:
            engine = h["engine"]
            width = engine.link.sync.projection.shape[0]
            engine.link.sync.max_hidden_bytes = STEP_ROWS * width * 4
            async with AsyncTreespecClient(h["addr"], timeout=300) as c:
                async def run(plain: bool):
                    return await asyncio.gather(*[
                        c.generate(prompt_ids=p, max_tokens=MAX_TOKENS, ignore_eos=True,
                                   no_speculation=plain) for p in PROMPTS])
                spec = await run(False)
                fallbacks = dict(engine.fallbacks)
                plain = await run(True)
            return spec, plain, fallbacks
    spec, plain, fallbacks = asyncio.run(go())
    # one step each while the last chunk's rows cross (the bound leaves room for a step
    # that finds the draft still taking in a catch-up: busy, a token more to send)
    assert fallbacks.get("syncing", 0) <= 2 * len(PROMPTS), fallbacks
    assert set(fallbacks) <= {"syncing", "busy"}, fallbacks
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert sum(o.stats["draft_tokens"] for o in spec) > 0
