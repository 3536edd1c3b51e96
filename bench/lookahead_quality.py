"""What a lookahead hit's tree is worth: tokens a step commits when every step's tree
was drafted while the last one verified, against trees drafted when asked (CPU).

    python bench/lookahead_quality.py --out bench/results/lookahead_quality_cpu.json
        [--configs model:chain4,eagle3:tree-small] [--prompts 8]
        [--prompt-tokens 256] [--max-tokens 64]

Both services in process on the shipped tiny pair, greedy, one prompt at a time (the
held-out code files' first --prompt-tokens tokens). Per config two passes: serial
(`--lookahead 0`), then *oracle* lookahead: each sequence's first candidate is drafted by
the lookahead's own rule for the step's true outcome (plain greedy's tokens through the
step's tree, then the next), and the connection asks on every step (its price held
on), so every step after a sequence's first hits. The ratio of the two passes' accepted
tokens a step is what a hit costs in tokens: the instruments (`bench/replay.py
--shadow`) take their tokens from the replay and cannot show it.
The DFlash rows of `bench/results/lookahead_quality_cpu.json` come from its pre-drafting
trial (git 957a49b: guessed tokens inside its block), not kept.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from bench_accept import held_out_prompts  # noqa: E402
from inproc import greedy_reference, services  # noqa: E402
from treespec.common.client import AsyncTreespecClient  # noqa: E402
from treespec.common.model.paths import SHIPPED_DIR, SHIPPED_DRAFTS  # noqa: E402
from treespec.common.spec.tree import ROOT, TreeBatch  # noqa: E402
from treespec.draft_service import engine as draft_engine  # noqa: E402
from treespec.draft_service.lookahead import _extend  # noqa: E402
from treespec.verify_service.draft_sync import AheadPrice  # noqa: E402

TARGET = SHIPPED_DIR / "tiny-code"


def true_outcome(tokens: list[int], tree_tokens: list[int], tree_parents: list[int],
                 refs: list[list[int]]) -> list[int]:
    """Plain greedy's tokens through the tree (the accepted path), then the next."""
    ahead = next(f[len(tokens):] for f in refs if f[:len(tokens)] == tokens)
    outcome, at = [], ROOT
    while at is not None:
        outcome.append(ahead[len(outcome)])
        at = next((i for i, (t, p) in enumerate(zip(tree_tokens, tree_parents))
                   if p == at and t == outcome[-1]), None)
    return outcome


def oracle(refs: list[list[int]]):
    """draft_candidates whose first candidate per sequence is drafted for its outcome."""
    def draft(proposer, rows, per_seq, probe_kw=None):
        n = len(rows)
        outs = [true_outcome(r.tokens, r.tree_tokens, r.tree_parents, refs) for r in rows]
        keys = torch.full((n * per_seq, proposer.env.depth + 1), -1, dtype=torch.int32)
        trees = TreeBatch.padding(n * per_seq, proposer.env.num_nodes)
        try:
            _extend(proposer, [(r.seq_id, r.tokens + o, len(o)) for r, o in zip(rows, outs)])
            got = proposer.propose([r.seq_id for r in rows])
        finally:
            for r in rows:
                proposer.update(r.seq_id, r.tokens, 0, [], None)
        for b, o in enumerate(outs):
            keys[b * per_seq, :len(o)] = torch.tensor(o, dtype=torch.int32)
            trees.tokens[b * per_seq], trees.parents[b * per_seq] = got.tokens[b], got.parents[b]
        return keys, trees
    return draft


async def one_pass(method: str, envelope: str, prompts: list[list[int]], max_tokens: int,
                   lookahead: int) -> dict:
    async with services(TARGET, method, SHIPPED_DIR / SHIPPED_DRAFTS[method], envelope,
                        draft_kw={"lookahead": lookahead}, step_deadline_ms=10000) as h:
        async with AsyncTreespecClient(h["addr"]) as c:
            outs = [await c.generate(prompt_ids=p, max_tokens=max_tokens, ignore_eos=True)
                    for p in prompts]
        steps = sum(o.stats["steps"] for o in outs)
        return {"steps": steps, "hits": h["engine"].lookahead["hits"],
                "accepted_per_step": sum(o.stats["accepted_tokens"] for o in outs) / steps,
                "outputs": [o.token_ids for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--configs", default="model:chain4,eagle3:chain4,eagle3:tree-small")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    a = ap.parse_args()
    prompts = held_out_prompts(TARGET, a.prompts, a.prompt_tokens)
    refs = [p + greedy_reference(TARGET, p, a.max_tokens + 16) for p in prompts]
    rows = []
    real = draft_engine.draft_candidates
    AheadPrice.worth = lambda self, step_id: True       # every step asks (the CPU's wait
                                                        # would price the lookahead off)
    for config in a.configs.split(","):
        method, envelope = config.split(":")
        draft_engine.draft_candidates = real
        serial = asyncio.run(one_pass(method, envelope, prompts, a.max_tokens, 0))
        draft_engine.draft_candidates = oracle(refs)
        ahead = asyncio.run(one_pass(method, envelope, prompts, a.max_tokens, 1))
        row = {"method": method, "envelope": envelope,
               "serial_accepted_per_step": round(serial["accepted_per_step"], 3),
               "hit_accepted_per_step": round(ahead["accepted_per_step"], 3),
               "ratio": round(ahead["accepted_per_step"] / serial["accepted_per_step"], 3),
               "hits": ahead["hits"], "steps": ahead["steps"],
               "identical": serial["outputs"] == ahead["outputs"]}
        print(json.dumps(row), flush=True)
        rows.append(row)
    draft_engine.draft_candidates = real
    Path(a.out).write_text(json.dumps({"args": vars(a), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
