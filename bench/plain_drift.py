"""Does plain decode slow down inside one verify process, and why?

    python bench/plain_drift.py --out bench/results/plain_drift.json [--batch 32]

bench/drafters.py's second plain pass, minutes after its first in the same verify
process, is ~3.5 % slower at b32 / b64 and not at b1. Two causes fit: the GPU warming,
or the KV pages' order (after requests of mixed lengths have come and gone, a new
sequence's pages lie all over the pool). One verify service (the drafters bench's
Qwen3-8B-shaped target, speculation off, its page count) runs plain passes at one batch:
back to back, after a scramble (requests of mixed prompt and output lengths, so their
pages return in mixed order), and after an idle. Heat slows passes with time and the
idle undoes it; the page order slows only the passes after the scramble, idle or not.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path


from drafters import checkpoints, pages, shape_args, target_name
from e2e_bench import start, throughput
from step_metrics import metrics_url
from treespec.common.client import AsyncTreespecClient
from treespec.common.serving.launch import cli_command

VOCAB = 151936


async def scramble(addr: str, n: int, ctx: int, max_tokens: int, rng: random.Random) -> None:
    """n requests at once, prompt and output lengths drawn at random: they finish one by
    one, each returning its pages as it goes."""
    async with AsyncTreespecClient(addr, timeout=600) as c:
        await asyncio.gather(*[
            c.generate(prompt_ids=[rng.randrange(VOCAB) for _ in range(rng.randint(16, ctx))],
                       max_tokens=rng.randint(1, max_tokens), ignore_eos=True,
                       no_speculation=True)
            for _ in range(n)])


def main() -> None:
    ap = shape_args(__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--passes", type=int, default=2, help="passes in each phase")
    ap.add_argument("--idle-s", type=float, default=45.0)
    a = ap.parse_args()
    a.batches = f"1,{a.batch},64"           # pages() sizes the pool as the drafters bench
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    checkpoints(a, work)
    rng = random.Random(7)
    prompts = [[rng.randrange(VOCAB) for _ in range(a.ctx)] for _ in range(a.batch)]
    v = start("verify", cli_command(
        "verify", "--model", str(work / target_name(a)), "--port", "0", "--device", a.device,
        "--max-batch", "64", "--num-blocks", str(pages(a)), "--metrics-port", "0",
        "--speculation", "off"))
    t0, res = time.monotonic(), {"batch": a.batch, "ctx": a.ctx, "passes": []}
    try:
        url = metrics_url(v)

        def passes(phase: str) -> None:
            for _ in range(a.passes):
                r = throughput(v.addr, prompts, a.max_tokens, no_spec=True, metrics=url)
                res["passes"].append({"phase": phase, "at_s": round(time.monotonic() - t0, 1),
                                      **{k: r.get(k) for k in ("tok_s", "step_ms",
                                                               "verify_ms")}})
                print(json.dumps(res["passes"][-1]), flush=True)

        passes("fresh")
        passes("back to back")
        for _ in range(2):
            asyncio.run(scramble(v.addr, 64, a.ctx, a.max_tokens, rng))
        passes("after scramble")
        time.sleep(a.idle_s)
        passes("after idle")
    finally:
        v.stop()
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
