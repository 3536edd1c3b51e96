"""Long prompts at batch with a feature drafter: steps their rows spend `syncing`, and tok/s.

    python bench/prompt_sync.py [--n 8] [--ctx 512] [--prefill-tokens 128] [--step-rows 32]

The shipped tiny pair (tiny-code, tiny-code-eagle3, chain4), both services in process on
the CPU: plain decode (no_speculation) and then EAGLE-3 on N prompts sent at once, each
in its own pair of services. --step-rows bounds the hidden rows a step's request carries
(32 rows against 128-token chunks: a GPU's 8 MB bound, 1,024 rows of 8 KB, against
4,096-token chunks); 0 leaves the bound as served. tok/s counts prefill too.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from inproc import services  # noqa: E402
from treespec.common.client import AsyncTreespecClient  # noqa: E402
from treespec.common.model.paths import SHIPPED_DIR  # noqa: E402

TARGET, HEAD = SHIPPED_DIR / "tiny-code", SHIPPED_DIR / "tiny-code-eagle3"


async def run(a: argparse.Namespace, prompts: list[list[int]], plain: bool) -> dict:
    async with services(TARGET, "eagle3", HEAD, "chain4",
                        draft_kw={"target_embeddings": str(TARGET)},
                        prefill_tokens=a.prefill_tokens, max_batch=a.n, num_blocks=4096,
                        step_deadline_ms=2000) as h:
        engine = h["engine"]
        if a.step_rows:
            width = engine.link.sync.projection.shape[0]
            engine.link.sync.max_hidden_bytes = a.step_rows * width * 4
        async with AsyncTreespecClient(h["addr"], timeout=600) as c:
            await c.generate(prompt_ids=prompts[0][:64], max_tokens=4, no_speculation=plain)
            engine.fallbacks.clear()
            t0 = time.perf_counter()
            outs = await asyncio.gather(*[
                c.generate(prompt_ids=p, max_tokens=a.max_tokens, ignore_eos=True,
                           no_speculation=plain) for p in prompts])
            seconds = time.perf_counter() - t0
    return {"ids": [o.token_ids for o in outs], "tok_s": a.n * a.max_tokens / seconds,
            "fallbacks": dict(engine.fallbacks),
            "sequence_steps": sum(o.stats["steps"] for o in outs),
            "accepted": sum(o.stats["accepted_tokens"] for o in outs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prefill-tokens", type=int, default=128)
    ap.add_argument("--step-rows", type=int, default=32)
    a = ap.parse_args()
    prompts = [torch.randint(1, 6144, (a.ctx,), generator=torch.Generator().manual_seed(i))
               .tolist() for i in range(a.n)]
    plain = asyncio.run(run(a, prompts, True))
    spec = asyncio.run(run(a, prompts, False))
    print(f"plain {plain['tok_s']:.1f} tok/s; eagle3 {spec['tok_s']:.1f} tok/s, fallbacks "
          f"{spec['fallbacks']}, sequence steps {spec['sequence_steps']}, accepted "
          f"{spec['accepted']}, equal to plain: {spec['ids'] == plain['ids']}")


if __name__ == "__main__":
    main()
